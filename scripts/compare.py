"""Joins `kvsparse bench --device cuda --csv` with scripts/sdpa_bench.py's CSV: per grid point our time,
bandwidth as a fraction of the copy bandwidth, SDPA cuDNN/flash times and our time over cuDNN's."""
import csv, sys

ours = {(int(r["batch"]), int(r["ctx"]), int(r["hq"]), int(r["hk"])): r for r in csv.DictReader(open(sys.argv[1]))}
sdpa = {(int(r["batch"]), int(r["ctx"]), int(r["hq"]), int(r["hk"])): r for r in csv.DictReader(open(sys.argv[2]))}
print(f"{'batch':>5} {'ctx':>7} {'heads':>5} {'ours_us':>9} {'copy%':>6} {'cudnn_us':>9} {'cudnn%':>6} {'flash_us':>9} {'ours/cudnn':>10}")
for k in sorted(ours):
    o = ours[k]
    s = sdpa.get(k)
    us, frac, copy = float(o["us"]), float(o["frac_copy"]), float(o["copy_gbps"])
    if s:
        c, fl, b = float(s["cudnn_us"]), float(s["flash_us"]), float(s["bytes"])
        cf = b / (c * 1e-6) / 1e9 / copy
        print(f"{k[0]:>5} {k[1]:>7} {k[2]:>2}/{k[3]:<2} {us:>9.1f} {100*frac:>5.1f}% {c:>9.1f} {100*cf:>5.1f}% {fl:>9.1f} {us/c:>10.2f}")
    else:
        print(f"{k[0]:>5} {k[1]:>7} {k[2]:>2}/{k[3]:<2} {us:>9.1f} {100*frac:>5.1f}%   (no SDPA row)")
t = ours.get((32, 16384, 32, 8))
if t and (32, 16384, 32, 8) in sdpa:
    c = float(sdpa[(32, 16384, 32, 8)]["cudnn_us"])
    print(f"target B=32 L=16K 32/8: {100*float(t['frac_copy']):.1f}% of copy (>= 90%), {float(t['us'])/c:.2f}x cuDNN (<= 1.1x)")
t = ours.get((1, 131072, 32, 8))
if t:
    print(f"target B=1 L=128K 32/8: {100*float(t['frac_copy']):.1f}% of copy (>= 85%)")
