"""Where the warps of each profiled kernel stall, per SASS instruction, from Nsight
Compute's source page (PC sampling, section SourceCounters), read on a machine without
Nsight Compute. On the GPU machine:

    ncu --clock-control none -k regex:'device_kernel|nvjet' --section SourceCounters \\
        --section WarpStateStats -o /tmp/stall -f python3 scripts/ncu_short_wgrad.py
    ncu -i /tmp/stall.ncu-rep --page source --csv --print-source sass > stall_sass.csv

then here: `python3 scripts/ncu_stall_table.py stall_sass.csv[.gz] [TOP] [--context LINE:BEFORE:AFTER ...]`.
Prints, per kernel, the samples by stall reason and the TOP instructions with the most
samples (their share, their three main reasons, how often they executed); --context
prints the instructions around a line of the first kernel (the line numbers printed).
"""

import csv
import gzip
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_kernels(path):
  """[(kernel name, header, rows)] from ncu's --page source --csv output."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", newline="") as f:
    kernels = []
    for row in csv.reader(f):
      if not row:
        continue
      if row[0] == "Kernel Name":
        kernels.append([row[1], None, []])
      elif row[0] == "Address":
        kernels[-1][1] = row
      elif kernels:
        kernels[-1][2].append(row)
  return kernels


def count(value):
  return int(value.replace(",", "") or 0)


def print_kernel(name, header, rows, top):
  column = {key: i for i, key in enumerate(header)}
  reasons = [key for key in header if key.startswith("stall_") and "Not Issued" not in key]
  total = sum(count(row[column[SAMPLES]]) for row in rows)
  print("=" * 100)
  print(f"{name[:160]}\n  {total} samples, {len(rows)} instructions")
  by_reason = sorted(((sum(count(row[column[r]]) for row in rows), r[6:]) for r in reasons),
                     reverse=True)
  print("  by reason: " + ", ".join(f"{r} {100 * n / total:.1f}%" for n, r in by_reason if n))
  order = sorted(range(len(rows)), key=lambda i: -count(rows[i][column[SAMPLES]]))
  for line in order[:top]:
    row = rows[line]
    samples = count(row[column[SAMPLES]])
    main = sorted(((count(row[column[r]]), r[6:]) for r in reasons), reverse=True)[:3]
    print(f"  {samples:6d} {100 * samples / total:5.1f}% L{line:<5d} {row[1].strip()[:64]:64s} "
          f"{', '.join(f'{r} {n}' for n, r in main if n)}; executed {row[column['Instructions Executed']]}")


def main(argv):
  path, rest = argv[1], argv[2:]
  top = int(rest.pop(0)) if rest and rest[0].isdigit() else 30
  contexts = rest[rest.index("--context") + 1:] if "--context" in rest else []
  kernels = read_kernels(path)
  for name, header, rows in kernels:
    print_kernel(name, header, rows, top)
  for spec in contexts:
    line, before, after = (int(x) for x in spec.split(":"))
    _, header, rows = kernels[0]
    column = {key: i for i, key in enumerate(header)}
    print("-" * 60)
    for i in range(max(0, line - before), min(len(rows), line + after + 1)):
      print(f"L{i:<5d} {rows[i][column[SAMPLES]]:>6s} executed {rows[i][column['Instructions Executed']]:>8s} "
            f"{rows[i][1].strip()[:100]}")


if __name__ == "__main__":
  main(sys.argv)
