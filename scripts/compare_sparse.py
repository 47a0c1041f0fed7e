"""Joins `kvsparse bench --device cuda --policy ... --csv` with scripts/sdpa_bench.py's CSV: per policy and
grid point, the sparse step against our dense kernel and against SDPA cuDNN (dense, contiguous K/V), and
the issue's targets at context 128K."""
import csv, sys

rows = list(csv.DictReader(open(sys.argv[1])))
sdpa = {(int(r["batch"]), int(r["ctx"]), int(r["hq"]), int(r["hk"])): r for r in csv.DictReader(open(sys.argv[2]))}
print(f"{'policy':<38} {'batch':>5} {'ctx':>7} {'select':>8} {'attend':>8} {'total':>8} {'dense':>8} {'cudnn':>8} {'x dense':>7} {'x cudnn':>7} {'sel/floor':>9} {'visited':>8}")
for r in rows:
    k = (int(r["batch"]), int(r["ctx"]), int(r["hq"]), int(r["hk"]))
    tot, dense = float(r["forward_us"]), float(r["dense_us"])
    c = float(sdpa[k]["cudnn_us"]) if k in sdpa else float("nan")
    floor = float(r["bound_floor_us"])
    sf = f"{float(r['select_us']) / floor:9.2f}" if floor > 0 else f"{'-':>9}"
    print(f"{r['policy']:<38} {k[0]:>5} {k[1]:>7} {float(r['select_us']):>8.1f} {float(r['attend_us']):>8.1f} {tot:>8.1f} {dense:>8.1f} {c:>8.1f} {dense / tot:>7.2f} {c / tot:>7.2f} {sf} {100 * float(r['visited']):>7.1f}%")
print("targets at 128K: quest(L/16) >= 6x dense at batch >= 8, >= 4x at batch 1, selection <= 1.2x bound read; quest(L/4) > top_p >= 4x")
for r in rows:
    if int(r["ctx"]) != 131072:
        continue
    b, x = int(r["batch"]), float(r["dense_us"]) / float(r["forward_us"])
    if r["policy"].startswith("quest(budget=8192)"):
        want = 6.0 if b >= 8 else 4.0
        sel = float(r["select_us"]) / float(r["bound_floor_us"])
        print(f"  quest L/16 batch {b}: {x:.2f}x dense (target {want}x) {'met' if x >= want else 'SHORT'}; selection {sel:.2f}x bound read (target 1.2x) {'met' if sel <= 1.2 else 'SHORT'}")
    elif "top_p" in r["policy"]:
        print(f"  quest L/4 > top_p batch {b}: {x:.2f}x dense (target 4x) {'met' if x >= 4.0 else 'SHORT'}")
