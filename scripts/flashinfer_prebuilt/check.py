"""Without a GPU: FlashInfer must resolve the two modules from the shim provider and load them (no build)."""
import os, sys, torch
import flashinfer, flashinfer.decode, flashinfer.topk
from flashinfer.jit import env as jit_env
from flashinfer.jit.core import JitSpecNvcc
from flashinfer.jit.topk import gen_topk_module
from flashinfer.jit.attention.modules import gen_batch_decode_module, get_batch_decode_uri

def no_build(self, *a, **k):
    raise SystemExit(f"FAIL: build() called for {self.name}")
JitSpecNvcc.build = no_build
print("providers:", jit_env.FLASHINFER_AOT_PROVIDERS)
print("targets:", jit_env._target_cuda_architectures())
args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 128, 128, 0, False, False)
for spec in (gen_topk_module(), gen_batch_decode_module(*args)):
    print(spec.name[:60], "is_aot:", spec.is_aot, spec.aot_artifacts[0].path if spec.aot_artifacts else None)
    assert spec.is_aot
m = flashinfer.topk.get_topk_module()          # the cached module the topk wrappers use
d = flashinfer.decode.get_batch_decode_module(*args)
raw = gen_topk_module().build_and_load()
need = ["radix_topk", "radix_topk_page_table_transform", "radix_topk_ragged_transform", "cub_topk",
        "cub_topk_page_table_transform", "cub_topk_ragged_transform", "cub_topk_workspace_size",
        "cub_topk_page_table_transform_workspace_size", "cub_topk_ragged_transform_workspace_size",
        "can_implement_filtered_topk", "fast_topk_clusters_exact",
        "fast_topk_clusters_exact_page_table_transform", "fast_topk_clusters_exact_ragged_transform"]
for n in need:
    assert callable(getattr(raw, n)), n
rawd = gen_batch_decode_module(*args).build_and_load()
for n in ("plan", "run", "workspace_size"):
    assert callable(getattr(rawd, n)), n
print("loaded:", type(raw).__name__, type(rawd).__name__, "functions:", len(need), "+ plan/run/workspace_size")
print("decode uri:", get_batch_decode_uri(*args))
print("OK: both modules load from the prebuilt provider, no JIT build")
