"""Every kernel compiles, for every constexpr configuration we ship, for sm_90 and sm_80.

The interpreter accepts code the real compiler rejects, so CI also compiles, without a GPU:
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` to PTX and (with the
ptxas Triton bundles) to a cubin. Options are the launchers' own: the same num_warps /
num_stages and ``enable_fp_fusion=ENABLE_FP_FUSION`` (False: no FMA contraction, so the compiled
kernels round like the interpreter and the references; see ``kernels/utils.py``).

Shipped configurations: fp32/fp16/bf16 x {the tiny test model (H 72, 6/3 heads, head_dim 12),
Llama-3-8B (H 4096, 32/8 heads, head_dim 128)}; greedy verification for the default SpecConfig
(depth 6, 48 draft tokens) and a chain (depth 4, 5 tokens); sampling verification for the
default SpecConfig at Llama-3's vocabulary (128256), 60 tree tokens at a 32000 vocabulary, and a
chain at the tiny model's 97. Deterministic mode's attention (``det_attention``) at both models'
heads, and its batch-invariant matmul: its one configuration per dtype, with and without bias, and
the alternative bf16 tilings its benchmark times (``BENCH_TILINGS``).

The compilation runs in a subprocess without ``TRITON_INTERPRET`` (under the interpreter
``triton.jit`` gives interpreted functions that cannot be compiled); run this file as a script
(``python tests/test_compile_ptx.py 90``) to see the JSON it reports.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ARCHS = [90, 80]
VERIFY_SAMPLING = [(6, 48, 128256), (6, 60, 32000), (4, 5, 97)]  # (depth, tree tokens, vocabulary)
VERIFY_CHAIN = [(4, 128256), (1, 97)]  # (drafted tokens, vocabulary)
MODELS = {"tiny": dict(H=72, HQ=6, HKV=3, D=12), "llama3_8b": dict(H=4096, HQ=32, HKV=8, D=128)}
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _i32(names: str) -> dict[str, str]:
    """The ``i32`` entries of a signature for the space-separated argument ``names``, in order."""
    return dict.fromkeys(names.split(), "i32")


def _specs():
    """``[(name, kernel, signature, constexprs, divisible_args, options)]`` mirroring the launchers."""
    import torch

    from tritonspec.kernels import aux_gather as ag
    from tritonspec.kernels import batch_invariant_matmul as bim
    from tritonspec.kernels import det_attention as da
    from tritonspec.kernels import kv_compact as kc
    from tritonspec.kernels import kv_write as kw
    from tritonspec.kernels import rms_norm as rn
    from tritonspec.kernels import tree_attention as ta
    from tritonspec.kernels import verify as vf
    from tritonspec.kernels import verify_chain as vc
    from tritonspec.kernels import verify_sampling as vs
    from tritonspec.kernels.utils import ENABLE_FP_FUSION, next_pow2, rms_config, sampling_config

    base = dict(enable_fp_fusion=ENABLE_FP_FUSION)
    specs = []

    def add(name, kernel, sig, constexprs, divisible, **options):
        specs.append((name, kernel, sig, constexprs, divisible, options))

    for dt_name, dt in DTYPES.items():
        torch_dt = getattr(torch, dt)
        p = f"*{dt_name}"
        for model, m in MODELS.items():
            H, HQ, HKV, D = m["H"], m["HQ"], m["HKV"], m["D"]
            block, warps = rms_config(H)
            for res in (False, True):
                sig = dict.fromkeys(["x_ptr", "r_ptr", "w_ptr", "y_ptr", "s_ptr"], p)
                sig |= _i32("M1 stride_x0 stride_x1 stride_r0 stride_r1") | {"eps": "fp32"}
                consts = dict(H=H, BLOCK_H=block, HAS_RESIDUAL=res)
                divisible = [a for a in sig if a not in ("M1", "eps")]
                name = f"rms_norm/{dt_name}/{model}/residual={res}"
                add(name, rn._rms_norm_kernel, sig, consts, divisible, **base, num_warps=warps)
            for norm in (False, True):
                n_aux = 3
                h = H if norm else n_aux * H
                b2, w2 = rms_config(h)
                sig = dict(aux_ptr=p, index_ptr="*i64", w_ptr=p, out_ptr=p, stride_aux="i32", eps="fp32")
                consts = dict(H=h, N_AUX=n_aux if norm else 1, BLOCK_H=b2, HAS_NORM=norm, PAD=-1)
                name = f"aux_gather/{dt_name}/{model}/fc_norm={norm}"
                add(name, ag._aux_gather_kernel, sig, consts, list(sig)[:5], **base, num_warps=w2)
            hd = HKV * D
            sig = dict(k_cache_ptr=p, v_cache_ptr=p, slots_ptr="*i64", k_ptr=p, v_ptr=p)
            sig |= _i32("stride_kb stride_ks stride_vb stride_vs stride_nb stride_nq Q S")
            consts = dict(HD=hd, BLOCK=min(next_pow2(hd), 1024), PAD=-1)
            divisible = [a for a in sig if a not in ("Q", "S")] if hd % 16 == 0 else list(sig)[:5]
            add(f"kv_write/{dt_name}/{model}", kw._kv_write_kernel, sig, consts, divisible, **base, num_warps=4)
            cfg = ta._attention_constexprs(D, torch_dt)
            cfg["DOT_UPCAST"] = False  # the interpreter-only path is never compiled
            sig = dict(q_ptr=p, k_ptr=p, v_ptr=p, prefix_ptr="*i64", mask_ptr="*i1", acc_ptr="*fp32", ml_ptr="*fp32")
            sig |= _i32("stride_qb stride_qq stride_qh stride_kb stride_ks stride_vb stride_vs")
            sig |= _i32("stride_mb stride_mq stride_mt Q T kv_len NS") | {"qk_scale": "fp32"}
            consts = dict(HQ=HQ, HKV=HKV, D=D, SPLIT=ta.SPLIT_KV, NEG=-1.0e30, **cfg)
            strides = [a for a in sig if a.startswith(("stride_q", "stride_k", "stride_v"))] if D % 16 == 0 else []
            divisible = list(sig)[:7] + strides
            name = f"tree_attention_partial/{dt_name}/{model}"
            add(name, ta._tree_attn_partial_kernel, sig, consts, divisible, **base, num_warps=4, num_stages=2)
            sig = dict(acc_ptr="*fp32", ml_ptr="*fp32", prefix_ptr="*i64", out_ptr=p) | _i32("QH kv_len NS")
            consts = dict(D=D, BLOCK_D=cfg["BLOCK_D"], SPLIT=ta.SPLIT_KV, NEG=-1.0e30)
            name = f"tree_attention_merge/{dt_name}/{model}"
            merge_warps = 1 if cfg["BLOCK_D"] <= 128 else 2
            add(name, ta._tree_attn_merge_kernel, sig, consts, list(sig)[:4], **base, num_warps=merge_warps)
            dcfg = da.det_attention_constexprs(D, HQ // HKV, torch_dt)
            dcfg["DOT_UPCAST"] = False
            sig = dict(q_ptr=p, k_ptr=p, v_ptr=p, pre_ptr="*i32", slots_ptr="*i32", counts_ptr="*i32")
            sig |= dict(acc_ptr="*fp32", ml_ptr="*fp32")
            sig |= _i32("stride_qb stride_qq stride_qh stride_kb stride_ks stride_vb stride_vs Q T NS q_offset causal")
            sig |= {"qk_scale": "fp32"}
            consts = dict(HQ=HQ, HKV=HKV, D=D, SPLIT=da.SPLIT, NEG=-1.0e30, **dcfg)
            warps = dict(num_warps=da.NUM_WARPS, num_stages=da.NUM_STAGES)
            name = f"det_attention_partial/{dt_name}/{model}"
            add(name, da._det_attn_partial_kernel, sig, consts, list(sig)[:8] + strides, **base, **warps)
            sig = dict(acc_ptr="*fp32", ml_ptr="*fp32", pre_ptr="*i32", counts_ptr="*i32", out_ptr=p)
            sig |= _i32("Q NS q_offset causal")
            consts = dict(HQ=HQ, D=D, BLOCK_D=dcfg["BLOCK_D"], SPLIT=da.SPLIT, NEG=-1.0e30)
            name = f"det_attention_merge/{dt_name}/{model}"
            add(name, da._det_attn_merge_kernel, sig, consts, list(sig)[:5], **base, num_warps=merge_warps)
            M = 7
            block_m = next_pow2(M)
            sig = dict(k_ptr=p, v_ptr=p, start_ptr="*i64", nodes_ptr="*i64") | _i32("stride_l stride_b")
            consts = dict(HD=hd, M=M, BLOCK_M=block_m, BLOCK_C=min(next_pow2(hd), max(8192 // block_m, 128)), NONE=-1)
            add(f"kv_compact/{dt_name}/{model}", kc._kv_compact_kernel, sig, consts, list(sig), **base, num_warps=4)
    for dt_name, dt in DTYPES.items():
        block_m, block_n, block_k, warps, stages = bim.CONFIGS[getattr(torch, dt)]
        for bias in (False, True):
            p = f"*{dt_name}"
            sig = (
                dict(a_ptr=p, b_ptr=p, c_ptr=p, bias_ptr=p)
                | _i32("M N K")
                | _i32("stride_ab stride_am stride_ak stride_bb stride_bk stride_bn stride_cb stride_cm stride_cn")
                | _i32("K_CHUNK NSPLIT")
            )
            consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias, UPCAST=False, PARTIAL=False)
            consts["INPUT_PRECISION"] = "ieee" if dt == "float32" else "tf32"
            divisible = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "K", "stride_am", "stride_bk", "stride_cm", "K_CHUNK"]
            name = f"batch_invariant_matmul/{dt_name}/bias={bias}"
            add(name, bim._bi_matmul_kernel, sig, consts, divisible, **base, num_warps=warps, num_stages=stages)
        # as batch_invariant_linear launches it (x [M, K] and weight.t(): unit strides along K, specialised to 1)
        sig_lin = {a: t for a, t in sig.items() if a not in ("stride_ak", "stride_bk", "stride_cn")}
        consts_lin = dict(consts, HAS_BIAS=False, stride_ak=1, stride_bk=1, stride_cn=1)
        divisible_lin = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "N", "K", "K_CHUNK"]
        divisible_lin += ["stride_ab", "stride_am", "stride_bn", "stride_cb", "stride_cm"]
        name = f"batch_invariant_linear/{dt_name}"
        add(name, bim._bi_matmul_kernel, sig_lin, consts_lin, divisible_lin, **base, num_warps=warps, num_stages=stages)
        # a fixed K split (``k_split``): the partial products' pass (fp32 tiles out), then their reduction
        add(
            f"batch_invariant_matmul/{dt_name}/k_split",
            bim._bi_matmul_kernel,
            dict(sig, c_ptr="*fp32"),
            dict(consts, PARTIAL=True),
            divisible,
            **base,
            num_warps=warps,
            num_stages=stages,
        )
        for bias in (False, True):
            sig_r = dict(w_ptr="*fp32", bias_ptr=p, c_ptr=p) | _i32("total N NSPLIT")
            consts_r = dict(BLOCK=bim.REDUCE_BLOCK, HAS_BIAS=bias)
            name = f"batch_invariant_reduce/{dt_name}/bias={bias}"
            add(name, bim._bi_reduce_kernel, sig_r, consts_r, list(sig_r)[:3], **base, num_warps=4)
        if dt_name == "bf16":  # the alternative tilings the benchmark times
            for tname, (block_m, block_n, block_k, warps, stages) in bim.BENCH_TILINGS.items():
                consts = dict(consts, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False)
                name = f"batch_invariant_matmul/bf16/tiling={tname}"
                add(name, bim._bi_matmul_kernel, sig, consts, divisible, **base, num_warps=warps, num_stages=stages)
    for depth, n in ((6, 48), (4, 5)):
        sig = dict.fromkeys(["tokens_ptr", "parents_ptr", "argmax_ptr", "nodes_ptr", "num_ptr", "emitted_ptr"], "*i64")
        sig["N"] = "i32"
        consts = dict(MAX_DEPTH=depth, BLOCK_N=max(next_pow2(n), 16), BLOCK_W=max(next_pow2(depth + 1), 16), NONE=-1)
        add(f"verify_greedy/depth={depth}/N={n}", vf._verify_greedy_kernel, sig, consts, list(sig)[:6], num_warps=1)
    for depth, n, vocab in VERIFY_SAMPLING:
        block_v, warps = sampling_config(vocab)
        sig = dict(tokens_ptr="*i64", parents_ptr="*i64", probs_ptr="*fp32", u_ptr="*fp32", xi_ptr="*fp32")
        sig |= dict(mark_ptr="*i8", nodes_ptr="*i64", num_ptr="*i64", emitted_ptr="*i64") | _i32("N V")
        consts = dict(MAX_DEPTH=depth, BLOCK_N=max(next_pow2(n), 16), BLOCK_W=max(next_pow2(depth + 1), 16))
        consts |= dict(BLOCK_V=block_v, ONE=vs.FIXED_ONE, NONE=-1)
        divisible = list(sig)[:9] + (["V"] if vocab % 16 == 0 else [])
        name = f"verify_sampling/depth={depth}/N={n}/V={vocab}"
        add(name, vs._verify_sampling_kernel, sig, consts, divisible, **base, num_warps=warps)
    for n, vocab in VERIFY_CHAIN:
        block_v = min(max(next_pow2(vocab), 16), 2048)
        sig = {"tokens_ptr": "*i64"} | dict.fromkeys(["probs_ptr", "q_ptr", "u_ptr", "xi_ptr"], "*fp32")
        sig |= dict.fromkeys(["nodes_ptr", "num_ptr", "emitted_ptr"], "*i64") | {"V": "i32"}
        consts = dict(N_DRAFT=n, BLOCK_W=max(next_pow2(n + 1), 16), BLOCK_V=block_v)
        divisible = list(sig)[:8] + (["V"] if vocab % 16 == 0 else [])
        warps = 1 if block_v <= 256 else 4 if block_v <= 1024 else 8
        add(f"verify_chain/n={n}/V={vocab}", vc._verify_chain_kernel, sig, consts, divisible, **base, num_warps=warps)
    return specs


def compile_all(arch: int) -> dict:
    """Compile every spec for ``sm_<arch>``; report PTX/cubin sizes and the vector loads seen."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    report = {}
    for name, kernel, sig, constexprs, divisible, options in _specs():
        signature = dict(sig)
        for k in constexprs:
            signature[k] = "constexpr"
        ordered = {a: signature[a] for a in kernel.arg_names}
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
        try:
            src = ASTSource(fn=kernel, signature=ordered, constexprs=constexprs, attrs=attrs)
            ck = triton.compile(src, target=target, options=options)
            ptx = ck.asm.get("ptx", "")
            cubin = ck.asm.get("cubin", b"")
            report[name] = dict(
                ptx=len(ptx),
                cubin=len(cubin),
                loads=sorted(set(re.findall(r"ld\.global(?:\.[a-z0-9]+)*\.v\d\.[a-z0-9]+", ptx))),
                fma=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
                divs=sorted(set(re.findall(r"\bdiv(?:\.[a-z0-9]+)*\.f32\b", ptx))),
                f2i=sorted(set(re.findall(r"\bcvt(?:\.[a-z0-9]+)*\.s64\.f32\b", ptx))),
                barriers=len(re.findall(r"\bbar\.sync\b", ptx)),
                atomics=len(re.findall(r"\b(?:atom|red)\.", ptx)),
                tf32=len(re.findall(r"\.tf32\b", ptx)),
                cp_async=len(re.findall(r"\bcp\.async\.(?:ca|cg)\b", ptx)),
            )
        except Exception as e:  # reported per kernel, asserted in the test
            report[name] = dict(error=f"{type(e).__name__}: {e}"[:2000])
    return report


_CACHE: dict[int, dict] = {}


def _report(arch: int) -> dict:
    if arch not in _CACHE:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run(
            [sys.executable, __file__, str(arch)], env=env, capture_output=True, text=True, timeout=1200
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        _CACHE[arch] = json.loads(proc.stdout.strip().splitlines()[-1])
    return _CACHE[arch]


_SPEC_NAMES = (
    [
        f"{op}/{dt}/{model}{suffix}"
        for dt in DTYPES
        for model in MODELS
        for op, suffixes in (
            ("rms_norm", ("/residual=False", "/residual=True")),
            ("aux_gather", ("/fc_norm=False", "/fc_norm=True")),
            ("kv_write", ("",)),
            ("tree_attention_partial", ("",)),
            ("tree_attention_merge", ("",)),
            ("det_attention_partial", ("",)),
            ("det_attention_merge", ("",)),
            ("kv_compact", ("",)),
        )
        for suffix in suffixes
    ]
    + [f"batch_invariant_matmul/{dt}/bias={b}" for dt in DTYPES for b in (False, True)]
    + [f"batch_invariant_matmul/{dt}/k_split" for dt in DTYPES]
    + [f"batch_invariant_linear/{dt}" for dt in DTYPES]
    + [f"batch_invariant_reduce/{dt}/bias={b}" for dt in DTYPES for b in (False, True)]
    + [f"batch_invariant_matmul/bf16/tiling={t}" for t in ("n32", "m16n32k128", "m16n16k256")]
    + ["verify_greedy/depth=6/N=48", "verify_greedy/depth=4/N=5"]
    + [f"verify_sampling/depth={d}/N={n}/V={v}" for d, n, v in VERIFY_SAMPLING]
    + [f"verify_chain/n={n}/V={v}" for n, v in VERIFY_CHAIN]
)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_to_ptx_and_cubin(arch):
    pytest.importorskip("triton")
    report = _report(arch)
    assert sorted(report) == sorted(_SPEC_NAMES)
    failed = {k: v["error"] for k, v in report.items() if "error" in v}
    assert not failed, failed
    for name, r in report.items():
        assert r["ptx"] > 0 and r["cubin"] > 0, name


@pytest.mark.parametrize("arch", ARCHS)
def test_rms_norm_ptx_vector_loads_and_no_fma(arch):
    """Read the PTX once: with H = 4096 every thread loads 16 contiguous bytes per access
    (``ld.global.v4.b32``: 4 fp32, or 8 fp16/bf16 packed in 4 x b32), and with fp-fusion off
    no fp32 FMA appears in the RMSNorm kernel (the sum of squares and the weight multiply
    round separately, like the reference)."""
    pytest.importorskip("triton")
    report = _report(arch)
    for dt in DTYPES:
        for res in (False, True):
            r = report[f"rms_norm/{dt}/llama3_8b/residual={res}"]
            assert any(ld.endswith(".v4.b32") for ld in r["loads"]), (dt, r["loads"])
            assert r["fma"] == 0, (dt, r["fma"])
    fc = report["aux_gather/bf16/llama3_8b/fc_norm=True"]
    assert any(ld.endswith(".v4.b32") for ld in fc["loads"]), fc["loads"]


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_invariant_matmul_ptx_has_no_split_k(arch):
    """The deterministic-mode matmul compiles for every dtype; one program per output tile walks the
    whole K loop (no atomics: no split-K reduction), fp32 uses IEEE products (no TF32 MMA), and the K tiles
    are copied to shared memory asynchronously (``cp.async``: the loads pipelined; an unspecialised K
    bound once dropped them)."""
    pytest.importorskip("triton")
    report = _report(arch)
    for dt in DTYPES:
        for bias in (False, True):
            r = report[f"batch_invariant_matmul/{dt}/bias={bias}"]
            assert r["ptx"] > 0 and r["cubin"] > 0 and r["atomics"] == 0, r
            if dt == "fp32":
                assert r["tf32"] == 0, r
        lin = report[f"batch_invariant_linear/{dt}"]  # the K tiles pipelined: 16-byte asynchronous copies
        assert lin["cp_async"] > 0, lin


@pytest.mark.parametrize("arch", ARCHS)
def test_det_attention_ptx_has_no_atomics_or_tf32(arch):
    """Deterministic mode's attention on a GPU: no atomics (each split's partials are stored, then merged
    in order by one program per head) and, in float32, IEEE products (no TF32 MMA)."""
    pytest.importorskip("triton")
    report = _report(arch)
    for dt in DTYPES:
        for model in MODELS:
            for part in ("partial", "merge"):
                r = report[f"det_attention_{part}/{dt}/{model}"]
                assert r["atomics"] == 0, r
                if dt == "fp32":
                    assert r["tf32"] == 0, r


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_sampling_ptx_rounds_like_the_reference(arch):
    """The sampling verifier is bit-exact only if the compiled arithmetic rounds like torch:
    fp32 division correctly rounded (``div.rn.f32``, not ``div.full``/``div.approx``), the fixed-point
    conversion truncating (``cvt.rzi.s64.f32``), no FMA, and a barrier between writing the removed
    tokens' marks and reading them back."""
    pytest.importorskip("triton")
    report = _report(arch)
    for d, n, v in VERIFY_SAMPLING:
        r = report[f"verify_sampling/depth={d}/N={n}/V={v}"]
        assert r["divs"] == ["div.rn.f32"], r["divs"]
        assert r["f2i"] == ["cvt.rzi.s64.f32"], r["f2i"]
        assert r["fma"] == 0 and r["barriers"] > 0, r


if __name__ == "__main__":
    print(json.dumps(compile_all(int(sys.argv[1]))))
