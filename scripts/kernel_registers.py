"""Registers, spills and shared memory of every kernel in one CUDA source, as ptxas reports
them for sm_90a with the library's flags (CMakeLists.txt: jaxfuse_cuda_settings). A kernel
change is checked here before GPU time is spent on it: a new spill or a register count past
a launch bound's budget shows up in seconds, where the GPU run would only show it as time.

    python scripts/kernel_registers.py cuda/gpu/quantize.cu [--grep RunAmax] [--python PY]

PY (default: this interpreter) must import jaxlib (the FFI headers), the nvidia cu13
headers (cuBLASLt) and, for the grouped GEMM files, cutlass_library.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

FLAGS = ["-O3", "-DNDEBUG", "-std=c++17", "-Xcompiler=-fPIC", "--expt-relaxed-constexpr",
         "--expt-extended-lambda", "-diag-suppress=940,2473",
         "-gencode=arch=compute_90a,code=sm_90a", "-DJAXFUSE_WITH_CUDA=1", "-Xptxas", "-v"]


def include_flags(python: str) -> list[str]:
  """-I flags for the headers the sources include, located through `python`'s packages."""
  probe = ("import os, jaxlib; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))\n"
           "import importlib.util as u\n"
           "s = u.find_spec('nvidia'); print(os.path.join(list(s.submodule_search_locations)[0],"
           " 'cu13', 'include') if s else '')\n"
           "try:\n  import cutlass_library\n  print(os.path.join(os.path.dirname("
           "cutlass_library.__file__), 'source'))\nexcept ImportError:\n  print('')\n")
  jaxlib_include, cuda_include, cutlass = subprocess.run(
      [python, "-c", probe], check=True, capture_output=True, text=True).stdout.splitlines()
  flags = ["-Icuda/include", "-isystem", jaxlib_include]
  if cuda_include and os.path.isdir(cuda_include):
    flags.append(f"-I{cuda_include}")
  if cutlass:
    flags += [f"-I{cutlass}/include", f"-I{cutlass}/tools/util/include"]
  return flags


def short_name(mangled: str) -> str:
  """The kernel with its template arguments and without namespaces or parameters
  (demangled by c++filt where there is one)."""
  try:
    name = subprocess.run(["c++filt", mangled], check=True, capture_output=True,
                          text=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return mangled[:100]
  for prefix in ("jaxfuse::", "(anonymous namespace)::", "gpu::", "cutlass::", "cute::"):
    name = name.replace(prefix, "")
  name = re.sub(r"^void ", "", name)
  depth, end = 0, len(name)
  for index, char in enumerate(name):  # cut the parameter list after the template arguments
    depth += char == "<"
    depth -= char == ">"
    if char == "(" and depth == 0:
      end = index
      break
  return name[:end][:110]


def report(ptxas_output: str, pattern: str) -> list[tuple[str, int, int, int]]:
  """(kernel, registers, spill store bytes, static shared bytes) per entry function."""
  rows, name, spill = [], None, 0
  for line in ptxas_output.splitlines():
    if match := re.search(r"Compiling entry function '(\S+)'", line):
      name, spill = match.group(1), 0
    elif match := re.search(r"(\d+) bytes spill stores", line):
      spill = int(match.group(1))
    elif (match := re.search(r"Used (\d+) registers", line)) and name is not None:
      shared = re.search(r"(\d+) bytes smem", line)
      if re.search(pattern, name):
        rows.append((short_name(name), int(match.group(1)), spill,
                     int(shared.group(1)) if shared else 0))
      name = None
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("source", help="a .cu file of cuda/gpu/")
  parser.add_argument("--grep", default="", help="regular expression on the mangled name")
  parser.add_argument("--python", default=sys.executable,
                      help="the interpreter whose packages provide the headers")
  args = parser.parse_args()
  os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
  command = ["nvcc", *FLAGS, *include_flags(args.python), "-c", args.source, "-o", os.devnull]
  result = subprocess.run(command, capture_output=True, text=True)
  if result.returncode != 0:
    print(result.stderr[-4000:], file=sys.stderr)
    return result.returncode
  rows = report(result.stderr, args.grep)
  width = max((len(row[0]) for row in rows), default=10)
  print(f"{'kernel':<{width}}  registers  spill bytes  static smem")
  for kernel, registers, spill, shared in rows:
    flag = "  <- spills" if spill else ""
    print(f"{kernel:<{width}}  {registers:9d}  {spill:11d}  {shared:11d}{flag}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
