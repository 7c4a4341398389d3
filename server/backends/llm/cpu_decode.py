"""Decode attention on the CPU, reading the paged KV cache in place: a small C kernel built at load.

Why: on a CPU a decode's attention is bound by memory, not arithmetic. gather + SDPA (attention.py)
copies every key and value of every decoding sequence out of the cache into a padded tensor, then
SDPA reads that copy again, through a transposed view it reads slower than a contiguous one: three
passes over the whole context, plus the padding, for one query per sequence. On a 2-core machine
with ~15 GB/s of memory bandwidth that was two thirds of a burst's decode step (48 sequences of ~200
keys: ~8 ms a layer against ~4 for the layer's matmuls). No maintained kernel reads a paged cache in
place on a CPU here: PyTorch's `varlen_attn` is CUDA-only, compiled `flex_attention` fails to build
its CPU template for a paged block mask, transformers' `sdpa_paged` gathers like attention.py does
(docs/architecture.md, "Generation step cost"). So this kernel does the one thing needed: for each
(sequence, KV head), the query heads that share that KV head score its keys once, straight from their
cache blocks, then sum its values weighted by the softmax: each key and value is read once, nothing
is padded or copied.

It is plain C (no PyTorch headers, so it builds in about a second) compiled with the machine's C
compiler for the machine it runs on (`-march=native`), cached by the source, the flags and the CPU's
feature flags, called through ctypes (which lets go of the GIL for the call) with the tensors'
pointers; OpenMP spreads the sequences over torch's intra-op thread count (and is torch's own libgomp,
which the process has loaded already: one OpenMP runtime, one pool of threads). Where no
C compiler is found or the build fails, `load` returns None and the engine keeps gather + SDPA (the
log and `describe()` say which). `FERRY_CPU_DECODE_KERNEL=0` turns it off (for before/after runs).

Scope: float32 caches, one query per sequence (decodes); prompt chunks and drafted tokens keep
gather + SDPA, whose matmuls are the cost there. Results differ from SDPA's in float32 rounding
(another summation order), as oneDNN's linear layers differ from MKL's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from server.backends.llm.attention import block_tables

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* q [n, heads, dim]; k, v [slots, kv_heads, dim]; table [n, width] cache blocks of each sequence;
   sequence i attends to its keys first[i] .. ctx[i] - 1; out [n, heads, dim]. Query head h reads KV
   head h / (heads / kv_heads), as transformers' repeat_kv lays them out. One sequence per task: its
   keys are read a whole cache row (every KV head) at a time, block after block, in address order. */
void ferry_paged_decode(const float *q, const float *k, const float *v, const int64_t *table, int64_t width,
                        const int32_t *ctx, const int32_t *first, int64_t n, int64_t heads, int64_t kv_heads,
                        int64_t dim, int64_t block_size, float scale, float *out, int threads, int64_t longest) {
    const int64_t group = heads / kv_heads, row = kv_heads * dim;
    #pragma omp parallel num_threads(threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(heads * (longest > 0 ? longest : 1)));
        float *peak = (float *)malloc(sizeof(float) * (size_t)heads);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            const int64_t c0 = first[i], c1 = ctx[i], len = c1 - c0;
            const float *qi = q + i * heads * dim;
            float *o = out + i * heads * dim;
            memset(o, 0, sizeof(float) * (size_t)(heads * dim));
            if (len <= 0) continue;
            for (int64_t h = 0; h < heads; h++) peak[h] = -INFINITY;
            for (int64_t t = c0; t < c1;) {
                const int64_t block = t / block_size, end = (block + 1) * block_size < c1 ? (block + 1) * block_size : c1;
                const float *kr = k + (table[i * width + block] * block_size + t % block_size) * row;
                for (; t < end; t++, kr += row) {
                    for (int64_t h = 0; h < heads; h++) {
                        const float *qh = qi + h * dim, *kp = kr + (h / group) * dim;
                        float acc = 0.0f;
                        #pragma omp simd reduction(+:acc)
                        for (int64_t d = 0; d < dim; d++) acc += qh[d] * kp[d];
                        acc *= scale;
                        scores[h * len + (t - c0)] = acc;
                        if (acc > peak[h]) peak[h] = acc;
                    }
                }
            }
            for (int64_t h = 0; h < heads; h++) {
                float sum = 0.0f, *s = scores + h * len;
                for (int64_t j = 0; j < len; j++) { s[j] = expf(s[j] - peak[h]); sum += s[j]; }
                const float inv = 1.0f / sum;
                for (int64_t j = 0; j < len; j++) s[j] *= inv;
            }
            for (int64_t t = c0; t < c1;) {
                const int64_t block = t / block_size, end = (block + 1) * block_size < c1 ? (block + 1) * block_size : c1;
                const float *vr = v + (table[i * width + block] * block_size + t % block_size) * row;
                for (; t < end; t++, vr += row) {
                    for (int64_t h = 0; h < heads; h++) {
                        const float p = scores[h * len + (t - c0)], *vp = vr + (h / group) * dim;
                        float *oh = o + h * dim;
                        #pragma omp simd
                        for (int64_t d = 0; d < dim; d++) oh[d] += p * vp[d];
                    }
                }
            }
        }
        free(scores);
        free(peak);
    }
}
"""
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_SWITCH = "FERRY_CPU_DECODE_KERNEL"


@dataclass(slots=True)
class DecodeStep:
    """What the kernel needs of one step's decodes, built once and shared by every layer."""

    rows: torch.Tensor  # [N] the decodes' rows in the flattened step
    table: np.ndarray  # [N, width] int64 cache blocks (blocks given back behind a window: 0, never read)
    ctx: np.ndarray  # [N] int32 keys each sequence has, this step's included
    first_full: np.ndarray  # [N] int32 zeros: a full layer attends from the first key
    first_window: np.ndarray | None  # [N] int32 the first key inside the sliding window (None: no layer slides)
    longest: int  # the most keys any of them attends to (the kernel's scratch per thread)
    block_size: int
    kernel: DecodeKernel

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sliding: bool,
               out: torch.Tensor) -> None:
        """One layer: the decodes' rows of `out` ([T, H, D]) from their queries' rows of `q`."""
        out.index_copy_(0, self.rows, self.kernel.attend(q.index_select(0, self.rows), k_cache, v_cache, self, sliding))


class DecodeKernel:
    """The compiled kernel of this machine; `attend` runs it for one layer."""

    def __init__(self, library: ctypes.CDLL):
        fn = library.ferry_paged_decode
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, ctypes.c_float, p, i32, i64]
        fn.restype = None
        self._fn = fn

    def build_step(self, rows: list[int], computed: list[int], tables: list[list[int]], block_size: int,
                   window: int | None) -> DecodeStep:
        """`computed`: tokens each decoding sequence had before this step (its new token is one more)."""
        ctx = np.asarray(computed, dtype=np.int32) + 1
        width = max(len(t) for t in tables)
        table = block_tables(tables, width)
        if int(ctx.max()) > width * block_size:
            raise ValueError("a decoding sequence has more keys than its block table holds")
        first_window = np.maximum(ctx - window, 0).astype(np.int32) if window else None
        return DecodeStep(torch.tensor(rows, dtype=torch.long), table, ctx, np.zeros_like(ctx), first_window,
                          int(ctx.max()), block_size, self)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: DecodeStep,
               sliding: bool) -> torch.Tensor:
        """q: [N, H, D] contiguous float32, one query per decoding sequence; caches [slots, KVH, D]."""
        n, heads, dim = q.shape
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (q, k_cache, v_cache)):
            raise ValueError("the CPU decode kernel reads contiguous float32 queries and caches")  # raw pointers below
        out = torch.empty_like(q)
        first = step.first_window if sliding and step.first_window is not None else step.first_full
        self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), step.table.ctypes.data, step.table.shape[1],
                 step.ctx.ctypes.data, first.ctypes.data, n, heads, k_cache.shape[1], dim, step.block_size,
                 dim ** -0.5, out.data_ptr(), torch.get_num_threads(), step.longest)
        return out


def load(device: torch.device, dtype: torch.dtype, kv_heads: int, heads: int) -> DecodeKernel | None:
    """The kernel where it applies (CPU, float32, whole query groups per KV head) and builds; else None."""
    if device.type != "cpu" or dtype != torch.float32 or heads % kv_heads:
        return None
    if os.environ.get(_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        log.info("CPU decode attention kernel turned off (%s); decodes use gather + SDPA", _SWITCH)
        return None
    try:
        return DecodeKernel(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("the CPU decode attention kernel could not be built (%s); decodes use gather + SDPA", exc)
        return None


def _compiler() -> list[str]:
    configured = (sysconfig.get_config_var("CC") or "").split()
    for candidate in (configured, ["cc"], ["gcc"], ["clang"]):
        if candidate and shutil.which(candidate[0]):
            return candidate
    raise RuntimeError("no C compiler found (cc, gcc or clang)")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("FERRY_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ferry", "kernels")
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:  # a read-only home: a private temporary folder
        return Path(tempfile.mkdtemp(prefix="ferry-kernels-"))


def _build() -> Path:
    """The shared library for this source, flags and CPU; built once, then reused. Looked up before any
    compiler is: a cache filled where one was (FERRY_KERNEL_CACHE in an image's build stage) serves a
    machine that has none. Servers starting together may build it at once: each writes its own file and
    renames it into place."""
    key = hashlib.sha256("\0".join([_SOURCE, *_FLAGS, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    folder = _cache_dir()
    target = folder / f"ferry_decode_{key}.so"
    if target.exists():
        return target
    compiler = _compiler()
    source = folder / f"ferry_decode_{key}.{os.getpid()}.c"
    partial = folder / f"ferry_decode_{key}.{os.getpid()}.so"
    source.write_text(_SOURCE)
    try:
        done = subprocess.run([*compiler, *_FLAGS, "-o", str(partial), str(source), "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler[0]} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        source.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return target
