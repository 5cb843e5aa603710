"""Redraw the plot (and the Markdown table) of a saved benchmark run.

    python benchmarks/plot.py mla_bench_results/bench.json [-o out.png] [--md out.md] [--impls ours,flashmla]
"""

import argparse
import json
import sys

from mla_backend.bench_report import markdown, plot_results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="bench.json written by `mla-backend bench`")
    p.add_argument("-o", "--out", help="PNG path (default: next to the JSON)")
    p.add_argument("--md", help="also write the Markdown table here")
    p.add_argument("--impls", help="comma list of impls to draw (default: all in the file)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    impls = args.impls.split(",") if args.impls else data["impls"]
    out = args.out or args.json.rsplit(".", 1)[0] + ".png"
    if not plot_results(data["results"], impls, out, f"MLA decode, {data['env'].get('gpu')}"):
        print("matplotlib is not installed: no plot")
    else:
        print(f"wrote {out}")
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(data["results"], impls, data["env"], data["settings"]))
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
