"""Per-role totals of an Nsight Compute source page (SASS) of the warp-specialised split kernel.

    ncu ... --section SourceCounters --import-source yes -o rep python3 scripts/quick_time.py --shapes ... --ncu
    ncu --import rep.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    python3 scripts/ncu_roles.py sass.csv.gz [--fp8] [--transposed] [--blocks BLOCKS_PER_WARP]

The SASS is cut at each role's USETMAXREG (its setmaxnreg value names the role in that variant, see
``register_budget``: pass the variant's fp8 cache / transposed (tws, h x q_len <= 16) flags);
prints each role's stall samples by reason, its instructions per warp and block (given the blocks each
warp processes), and the instructions with the most samples.
"""
import collections
import csv
import gzip
import sys

from mla_backend.kernels.sm90.protocol import register_budget


def main(path: str, fp8: bool, transposed: bool, blocks_per_warp: float = 0) -> None:
    rows = list(csv.reader(gzip.open(path, "rt") if path.endswith(".gz") else open(path)))
    hdr, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    names = {hex(regs): role for role, regs in zip(("WG0", "WG1", "producer"), register_budget(fp8, transposed=transposed))}
    role, samples, instr, top = "prologue", collections.defaultdict(collections.Counter), \
        collections.defaultdict(collections.Counter), []
    for r in data:
        src = r[col["Source"]]
        if "USETMAXREG" in src:
            role = names.get(src.split()[-1].rstrip(";"), src)
        toks = src.split()
        op = (toks[1] if toks and toks[0].startswith("@") else toks[0] if toks else "").split(".")[0]
        s = num(r[col["Warp Stall Sampling (All Samples)"]])
        samples[role]["all"] += s
        for x in stalls:
            samples[role][x[6:]] += num(r[col[x]])
        instr[role][op] += num(r[col["Instructions Executed"]])
        top.append((s, role, src[:80]))
    for role, c in samples.items():
        reasons = ", ".join(f"{k} {100 * v / c['all']:.0f}%" for k, v in c.most_common() if k != "all" and v > 0.03 * c["all"])
        line = f"{role:9s} samples {c['all']:8.0f}: {reasons}"
        if blocks_per_warp:
            per = sum(instr[role].values()) / blocks_per_warp
            line += f"\n          {per:.0f} instructions per warp per block: " + ", ".join(
                f"{k} {v / blocks_per_warp:.0f}" for k, v in instr[role].most_common(12))
        print(line)
    for s, role, src in sorted(top, key=lambda t: -t[0])[:20]:
        print(f"{s:7.0f} {role:9s} {src}")


if __name__ == "__main__":
    args = sys.argv[1:]
    blocks = float(args[args.index("--blocks") + 1]) if "--blocks" in args else 0
    main(args[0], "--fp8" in args, "--transposed" in args, blocks)
