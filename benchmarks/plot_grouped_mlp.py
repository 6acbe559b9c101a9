"""Plot of the grouped MLP token sweep: TFLOP/s (forward + backward) against tokens for
jaxfuse and the baselines, from the newest benchmarks/results/grouped_mlp_*.json.

    python -m benchmarks.plot_grouped_mlp [--results FILE] [--out FILE]

Writes benchmarks/results/grouped_mlp_tflops.png by default (matplotlib, Agg backend).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
SERIES = (  # (row key, label, style)
    ("jaxfuse_tflops", "jaxfuse.grouped_mlp", dict(color="tab:green", marker="o", lw=2.5)),
    ("jaxfuse_fp8_tflops", "jaxfuse.grouped_mlp, FP8 per-group",
     dict(color="tab:olive", marker="D", ls="--")),
    ("torch_tflops", "torch._grouped_mm + eager SwiGLU", dict(color="tab:red", marker="s")),
    ("tokamax_tflops", "tokamax.ragged_dot (Mosaic GPU) + jnp SwiGLU",
     dict(color="tab:purple", marker="v")),
    ("ragged_dot_tflops", "jax.lax.ragged_dot + jnp SwiGLU", dict(color="tab:blue", marker="^")),
)


def newest_results() -> pathlib.Path:
  files = sorted(RESULTS_DIR.glob("grouped_mlp_*.json"), key=lambda p: p.stat().st_mtime)
  if not files:
    raise SystemExit(f"no grouped_mlp_*.json under {RESULTS_DIR}; run "
                     "python -m benchmarks.bench_grouped_mlp first")
  return files[-1]


def plot(results: dict, out: pathlib.Path, pass_name: str = "fwd+bwd") -> pathlib.Path:
  rows = sorted((r for r in results["rows"]
                 if r.get("section") == "sweep" and r.get("pass") == pass_name),
                key=lambda r: r["tokens"])
  if not rows:
    raise SystemExit(f"no sweep rows for pass {pass_name!r} in the results")
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
  for key, label, style in SERIES:
    points = [(r["tokens"], r[key]) for r in rows if r.get(key)]
    if points:
      ax.plot(*zip(*points), label=label, **style)
  ax.set_xscale("log", base=2)
  ax.set_xticks([r["tokens"] for r in rows], [f"{r['tokens'] // 1024}k" for r in rows])
  ax.set_xlabel("tokens (routed rows)")
  ax.set_ylabel("TFLOP/s")
  first = rows[0]
  ax.set_title(f"Grouped MLP {pass_name}, {first['experts']} experts, SwiGLU, "
               f"H={first['hidden']} F={first['ffn']}", fontsize=10)
  ax.set_ylim(bottom=0)
  ax.grid(True, alpha=0.3)
  ax.legend(loc="best", fontsize=9)
  device = results.get("device", "?")
  commit = str(results.get("commit", "?"))[:8]
  fig.text(0.99, 0.01, f"{device}, {results.get('date', '?')[:10]}, commit {commit}",
           ha="right", va="bottom", fontsize=7, color="gray")
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out)
  plt.close(fig)
  print(f"wrote {out}")
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--results", type=pathlib.Path, default=None,
                      help="results JSON (default: the newest grouped_mlp_*.json)")
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR / "grouped_mlp_tflops.png")
  args = parser.parse_args()
  path = args.results or newest_results()
  print(f"reading {path}")
  plot(json.loads(path.read_text()), args.out)


if __name__ == "__main__":
  main()
