"""One line per run of CUTLASS launches in a `scripts/ncu_check_kernels.sh --metrics` CSV:
kernel kind, launches, and the median launch's duration, DRAM bytes read and written, L2
hit rate and tensor-pipe activity. Read on a machine without Nsight Compute:

    python3 scripts/ncu_metrics_table.py NAME_metrics.csv[.gz]

A run is consecutive launches of one kind (the check times each kernel with a handful of
launches); two timed kernels of the same kind in a row (the wgrad's 1x2 and 1x1 ping-pong
kernels) fall into one run. Kinds: grouped / batched (CUTLASS's strided-batched reference),
ping (ping-pong) / coop (cooperative), prep (reads prepared per-group descriptors).
"""

import csv
import gzip
import sys

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "lts__t_sector_hit_rate.pct",
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed")


def kind(name):
  if "PrepareTensormaps" in name:
    return "prepare"
  schedule = "ping" if "Pingpong" in name else "coop"
  if "GroupProblemShape" not in name:
    return f"batched {schedule}"
  return f"grouped {schedule}" + (" prep" if "Prepared" in name else "")


def number(text):
  return float(text.replace(",", "") or 0)


def launches(path):
  """[(kind, time ns, read bytes, written bytes, L2 hit %, tensor %)] in launch order."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", newline="") as f:
    rows = [row for row in csv.reader(f) if row]
  start = next(i for i, row in enumerate(rows) if row[0] == "ID")
  header = rows[start]
  column = {key: i for i, key in enumerate(header)}
  result = []
  for row in rows[start + 2:]:  # the row after the header holds the units
    if len(row) != len(header):
      continue
    result.append((kind(row[column["Kernel Name"]]),
                   *(number(row[column[metric]]) for metric in METRICS)))
  return result


def main(argv):
  records = launches(argv[1])
  i = 0
  while i < len(records):
    j = i
    while j < len(records) and records[j][0] == records[i][0]:
      j += 1
    run = sorted(records[i:j], key=lambda record: record[1])
    name, time, read, written, hit, tensor = run[len(run) // 2]
    print(f"{name:18s} launches {j - i:3d}  median {time / 1e3:8.1f} us  DRAM read "
          f"{read / 1e9:6.3f} GB, written {written / 1e9:6.3f} GB  L2 hit {hit:5.1f}%  "
          f"tensor pipe {tensor:5.1f}%")
    i = j


if __name__ == "__main__":
  main(sys.argv)
