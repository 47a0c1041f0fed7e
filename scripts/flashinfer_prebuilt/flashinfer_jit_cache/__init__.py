"""Stand-in for FlashInfer's `flashinfer-jit-cache` package (not on PyPI): one jit-cache provider holding the
modules prebuilt for sm_90a (H100/H200) that scripts/peer_quest_bench.py needs. Put the folder above this one
on PYTHONPATH; flashinfer 0.7.2.post1 (jit/env.py `_get_aot_providers`) then loads
jit_cache/<module>/<module>.so instead of JIT-compiling that module. See ../README.txt."""
from dataclasses import dataclass
from pathlib import Path
from typing import FrozenSet, Tuple

__version__ = "0.7.2.post1+cu130"  # must be flashinfer's version, optionally with a "+local" suffix
__git_version__ = "kvsparse-prebuilt"
jit_cache_dir = Path(__file__).resolve().parent / "jit_cache"


@dataclass(frozen=True)
class JitCacheProvider:
    provider_id: str
    distribution: str
    version: str
    jit_cache_dir: Path
    cuda_architectures: FrozenSet[str]
    modules: FrozenSet[str]


def get_jit_cache_providers() -> Tuple[JitCacheProvider, ...]:
    mods = frozenset(p.name for p in jit_cache_dir.iterdir() if (p / f"{p.name}.so").is_file())
    return (JitCacheProvider("kvsparse-prebuilt", "flashinfer-jit-cache", __version__, jit_cache_dir,
                             frozenset({"sm90a"}), mods),)


def get_jit_cache_dir() -> str:
    return str(jit_cache_dir)
