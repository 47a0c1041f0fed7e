#!/usr/bin/env python3
"""Slims the flashinfer-python wheel to what its JIT-compiled paged decode needs, so it can travel to a GPU
machine without internet (the device tool carries at most 64 MiB).

    python3 scripts/repack_flashinfer_wheel.py .whl/flashinfer_python-0.7.2.post1-py3-none-any.whl

writes .whl/slim/flashinfer_python-...whl (same name, so pip takes it as that version). Kept: every Python
file (the package imports most of them eagerly), the FlashInfer headers (data/include), the batch-decode
and FA2 batch-prefill (its tensor-core decode) and top-k sources and templates of data/csrc with its top-level headers, the CCCL and spdlog headers the JIT puts on
the include path. Dropped: all other kernel sources in data/csrc (~258 MB), CUTLASS (the decode kernel
includes none of it; an empty include directory is left for the -isystem flags), CUDA sources shipped for
other kernels inside the Python tree, subpackages of other kernels that are never imported (DROP_PY), tests
and docs of the vendored libraries. RECORD is rewritten."""
import base64
import hashlib
import sys
import zipfile
from pathlib import Path

# The paged decode, and the FA2 prefill kernel that its tensor-core decode (use_tensor_cores=True, backend
# "fa2") runs: every batch_prefill* source but the SM90 (FA3, CUTLASS) ones.
KEEP_CSRC = ("batch_decode.cu", "batch_decode_jit_binding.cu", "batch_decode_customize_config.jinja",
             "batch_decode_kernel_inst.jinja",
             # flashinfer.top_k / top_k_page_table_transform (scripts/peer_quest_bench.py): jit/topk.py's sources
             "topk.cu", "cub_topk.cu", "flashinfer_topk_binding.cu", "flashinfer_fast_topk_clusters_binding.cu")


def keep_csrc(f):
    return f in KEEP_CSRC or (f.startswith("batch_prefill") and "sm90" not in f)


KEEP_CCCL = ("cccl/libcudacxx/include/", "cccl/cub/cub/", "cccl/thrust/thrust/")
# Subpackages for other kernels that neither `import flashinfer` nor the decode wrapper imports (checked with
# sys.modules after importing flashinfer, .decode, .prefill, .page, .cascade and .jit.attention).
DROP_PY = ("experimental/b12x/", "moe_ep/kernel_src/", "experimental/cake_vsa_sm90_cute/", "attention/prims_ts/",
           "cute_dsl/attention/", "prims_ts/batched_gemm/", "topk_varlen/kernels/", "cute_dsl/sparse/",
           "mla/_sparse_mla_sm120/", "experimental/cake_mla_varq_dcp_decode/", "experimental/cake_lm_head_loss/",
           "experimental/cake_mxfp8_megamoe_ep16/", "msa_ops/cute_dsl/", "comm/mnnvl_cutedsl/")


def keep(name):
    if not name.startswith("flashinfer/"):
        return True  # dist-info
    rel = name[len("flashinfer/"):]
    if rel.startswith("data/"):
        d = rel[len("data/"):]
        if d.startswith("csrc/"):
            f = d[len("csrc/"):]
            return keep_csrc(f) or ("/" not in f and f.endswith((".h", ".cuh", ".inc")))
        if d.startswith("cccl/"):
            return d.startswith(KEEP_CCCL)
        if d.startswith("cutlass/"):
            return False
        return d.startswith(("include/", "spdlog/include/")) or "/" not in d
    if rel.startswith(DROP_PY):
        return False
    return rel.endswith((".py", ".pyi", ".typed")) or "/" not in rel


def main(src):
    src = Path(src)
    dst = src.parent / "slim" / src.name
    dst.parent.mkdir(exist_ok=True)
    record = None
    rows = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record = info.filename
                continue
            if not keep(info.filename):
                continue
            data = zin.read(info)
            zout.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{info.filename},sha256={digest},{len(data)}")
        for d in ("flashinfer/data/cutlass/include/.keep", "flashinfer/data/cutlass/tools/util/include/.keep"):
            zout.writestr(d, b"")
            rows.append(f"{d},sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,0")
        rows.append(f"{record},,")
        zout.writestr(record, "\n".join(rows) + "\n")
    print(f"{dst}: {dst.stat().st_size / 2**20:.1f} MiB ({len(rows) - 1} files)")


if __name__ == "__main__":
    main(sys.argv[1])
