"""The public API of docs/spec.md section 3: objects, names, errors, backends, the compiled op."""

import math
import os
import subprocess
import sys

import pytest
import torch
from tolerances import check_multi

import fasthealth as fh
from fasthealth.ops.layout import COUNT_FIELDS, FIELDS, FLOAT_FIELDS, TABLE_COLUMNS

NAN, INF = float("nan"), float("inf")


def test_compiled_cpu_backend_present_when_required():
    # `make test` sets FASTHEALTH_REQUIRE_CPU=1: a broken build must fail, not skip.
    if os.environ.get("FASTHEALTH_REQUIRE_CPU") == "1":
        assert "cpu" in fh.available_backends(), fh.ops.compiled.load_error
        want = os.environ.get("FASTHEALTH_CPU_ISA")
        isas = fh.ops.compiled.C.cpu_isas()
        assert isas[-1] == "base" and fh.ops.compiled.C.cpu_isa() == (want or isas[0])
    assert fh.available_backends()[-1] == "torch"


def test_cpu_isa_names_a_variant_this_processor_runs():
    if "cpu" not in fh.available_backends():
        pytest.skip(f"needs the compiled CPU kernel ({fh.ops.compiled.load_error})")
    code = ("import fasthealth as fh, torch\n"
            "fh.multi_tensor_stats([torch.ones(3)], backend='cpu')\n")
    env = dict(os.environ, FASTHEALTH_CPU_ISA="sse9")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "must be one of avx512, avx2, avx, base" in out.stderr


def test_tensor_stats_fields_dtypes_and_device():
    for dtype, fdt in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                       (torch.float16, torch.float32), (torch.float64, torch.float64),
                       (torch.int32, torch.float32), (torch.int64, torch.float64)]:
        s = fh.tensor_stats(torch.arange(10).to(dtype))
        for name in FIELDS:
            v = getattr(s, name)
            assert isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu"
            if name in COUNT_FIELDS:
                assert v.dtype == torch.int64
            elif name in FLOAT_FIELDS:
                assert v.dtype == fdt, (dtype, name, v.dtype)
            else:
                assert v.dtype == torch.bool
        assert s.max.item() == 9 and s.zero_count.item() == 1


def test_multi_tensor_stats_object():
    a = torch.tensor([1.0, NAN, 3.0])
    b = torch.tensor([[INF, 0.0], [2.0, -1.0]])
    c = torch.arange(6, dtype=torch.float64)
    s = fh.multi_tensor_stats([a, b, c], names=["a", "b", "c"])
    assert len(s) == 3 and s.names == ["a", "b", "c"]
    assert s[0].nan_count.item() == 1 and s["b"].posinf_count.item() == 1
    assert s[-1].numel.item() == 6
    assert s.per_tensor.numel.tolist() == [3, 4, 6]
    assert s.per_tensor.norm.dtype == torch.float64  # one float64 input widens the table
    assert s.total.numel.item() == 13 and s.total.nan_count.item() == 1
    assert s.all_finite.dtype == torch.bool and s.all_finite.dim() == 0
    assert s.ok is False
    assert s.nonfinite() == ["a", "b"]
    d = s.to_dict()
    assert d["total"]["inf_count"] == 1 and d["per_tensor"]["c"]["max"] == 5.0
    assert math.isnan(d["per_tensor"]["a"]["norm"])
    assert s.table.shape == (3, len(TABLE_COLUMNS))
    text = s.summary(k=3)  # k counts the non-finite rows too
    assert [r.split()[0] for r in text.splitlines()[2:]] == ["TOTAL", "!a", "!b", "c"]
    check_multi(s.raw, [a, b, c])
    with pytest.raises(KeyError):
        s["nope"]
    with pytest.raises(IndexError):
        s[3]
    assert fh.multi_tensor_stats([torch.ones(3)]).ok is True


def test_default_names_and_empty_call():
    s = fh.multi_tensor_stats([torch.ones(2), torch.ones(3)])
    assert s.names == ["0", "1"]
    e = fh.multi_tensor_stats([])
    assert len(e) == 0 and e.total.numel.item() == 0 and e.total.norm.item() == 0 and e.ok


def test_total_norm_matches_clip_grad_norm():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=g) for s in [(100, 30), (30,), (7, 7, 7)]]
    s = fh.multi_tensor_stats(ts)
    want = torch.nn.utils.get_total_norm([t.double() for t in ts])
    assert s.total.norm.item() == pytest.approx(want.item(), rel=1e-5)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.proj = torch.nn.Linear(8, 20, bias=True)
        self.proj.weight = self.emb.weight  # tied
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.proj(self.emb(x))


def test_check_grads_module_tied_and_missing():
    torch.manual_seed(0)
    m = Tied()
    m(torch.arange(5)).square().mean().backward()
    s = fh.check_grads(m)
    assert s.names == ["emb.weight", "proj.bias"]
    assert s.missing == ["unused.weight", "unused.bias"]
    grads = [m.emb.weight.grad, m.proj.bias.grad]
    check_multi(s.raw, grads)
    total = torch.nn.utils.get_total_norm([g.double() for g in grads])
    assert s.total.norm.item() == pytest.approx(total.item(), rel=1e-5)
    # the same through parameters and (name, parameter) pairs; a repeated parameter counts once
    s2 = fh.check_grads(list(m.parameters()) + [m.emb.weight])
    assert len(s2) == 2 and s2.total.numel.item() == s.total.numel.item()
    s3 = fh.check_grads(m.named_parameters())
    assert s3.names == s.names


def test_check_grads_errors_name_the_input():
    with pytest.raises(TypeError, match="item 1"):
        fh.check_grads([torch.nn.Parameter(torch.ones(2)), 3])
    with pytest.raises(TypeError, match="nn.Module"):
        fh.check_grads(42)
    m = Tied()
    m(torch.arange(3)).sum().backward()
    with pytest.raises(ValueError, match="init_process_group"):
        fh.check_grads(m, process_group=object())


def test_bad_inputs_raise_naming_the_input():
    ok = torch.ones(3)
    with pytest.raises(TypeError, match=r"input 1 \('w'\) is a list"):
        fh.multi_tensor_stats([ok, [1, 2]], names=["v", "w"])
    with pytest.raises(TypeError, match="input 1.*complex"):
        fh.multi_tensor_stats([ok, torch.ones(2, dtype=torch.complex64)])
    with pytest.raises(TypeError, match="input 0.*layout"):
        fh.multi_tensor_stats([torch.eye(3).to_sparse()])
    with pytest.raises(ValueError, match="input 1.*meta"):
        fh.multi_tensor_stats([ok, torch.ones(2, device="meta")])
    with pytest.raises(ValueError, match="meta"):
        fh.tensor_stats(torch.ones(2, device="meta"))
    with pytest.raises(TypeError, match="sequence of tensors"):
        fh.multi_tensor_stats(ok)
    with pytest.raises(TypeError, match="torch.Tensor"):
        fh.tensor_stats([1.0])
    with pytest.raises(ValueError, match="2 names for 1 tensors"):
        fh.multi_tensor_stats([ok], names=["a", "b"])


def test_backend_selection_and_errors(monkeypatch):
    t = torch.randn(100)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        fh.tensor_stats(t, backend="nope")
    with pytest.raises(ValueError, match="'cuda' backend runs on CUDA tensors only"):
        fh.tensor_stats(t, backend="cuda")
    monkeypatch.setenv("FASTHEALTH_BACKEND", "bogus")
    with pytest.raises(ValueError, match="FASTHEALTH_BACKEND='bogus'"):
        fh.tensor_stats(t)
    monkeypatch.setenv("FASTHEALTH_BACKEND", "torch")
    from fasthealth.ops import backends
    assert backends.resolve(None, t.device) == "torch"
    assert backends.resolve("auto", t.device) == "torch"
    monkeypatch.delenv("FASTHEALTH_BACKEND")
    expected = "cpu" if "cpu" in fh.available_backends() else "torch"
    assert backends.resolve(None, t.device) == expected


def test_requires_grad_inputs_and_views():
    w = torch.randn(10, 10, requires_grad=True)
    s = fh.tensor_stats(w)
    assert not s.norm.requires_grad
    assert s.norm.item() == pytest.approx(w.detach().double().norm().item(), rel=1e-5)


def test_check_tensor_health_output(capsys):
    assert fh.check_tensor_health(torch.ones(4), "fine") is True
    assert capsys.readouterr().out == ""
    t = torch.tensor([1.0, NAN, NAN, INF, -INF, 2.0])
    assert fh.check_tensor_health(t, "logits") is False
    assert capsys.readouterr().out == (
        "Problem detected in tensor 'logits':\n"
        "  - Contains NaN values!\n"
        "  - NaN count: 2\n"
        "  - Contains Inf values!\n"
        "  - Inf count: 2\n"
    )
    assert fh.check_tensor_health(torch.tensor([INF]), "x") is False
    assert capsys.readouterr().out == (
        "Problem detected in tensor 'x':\n  - Contains Inf values!\n  - Inf count: 1\n"
    )
    assert fh.check_tensor_health(torch.tensor([NAN])) is False
    assert capsys.readouterr().out == (
        "Problem detected in tensor 'tensor':\n  - Contains NaN values!\n  - NaN count: 1\n"
    )


def _needs_cpu_op():
    if "cpu" not in fh.available_backends():
        pytest.skip(f"compiled op unavailable: {fh.ops.compiled.load_error}")


def test_opcheck():
    _needs_cpu_op()
    op = torch.ops.fasthealth.multi_tensor_stats.default
    # opcheck compares eager and traced outputs with NaN != NaN, so these samples give tables
    # without NaN; NaN/Inf under torch.compile is checked by test_torch_compile_fullgraph.
    samples = [
        [torch.randn(5), torch.randn(3, 4).t()],
        [torch.randn(70000).bfloat16(), torch.randn(9).double(), torch.arange(7)],
        [torch.randn(4, 5)[:, ::2].half()],
    ]
    for args, hi, lo in [(a, math.inf, 0.0) for a in samples] + [(samples[1], 65504.0, 6e-5)]:
        result = torch.library.opcheck(op, (args, hi, lo))
        assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.slow
def test_torch_compile_fullgraph():
    _needs_cpu_op()
    torch._dynamo.reset()

    def f(a, b):
        s = fh.multi_tensor_stats([a, b])
        return s.total.norm, s.all_finite, s.per_tensor.nan_count

    a, b = torch.randn(100), torch.randn(10, 10)
    b[3, 3] = NAN
    got = torch.compile(f, fullgraph=True)(a, b)
    want = f(a, b)
    assert all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(got, want))
    assert got[1].item() is False and got[2].tolist() == [0, 1]


@pytest.mark.slow
def test_reference_traces_in_one_graph():
    """The benchmark's `compile` provider is torch.compile of the reference: it must trace
    without graph breaks (inductor's own code generation is exercised on the GPU bench)."""
    from fasthealth.ops import reference

    torch._dynamo.reset()
    ts = [torch.randn(100), torch.randn(10, 10).bfloat16(), torch.randn(1), torch.empty(0)]
    ts[0][5] = NAN
    f = torch.compile(reference.multi_tensor_stats, fullgraph=True, backend="aot_eager")
    for hi, lo in [(math.inf, 0.0), (65504.0, 6.1e-5)]:
        got, want = f(ts, hi, lo), reference.multi_tensor_stats(ts, hi, lo)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_reference_rounds_thresholds_like_float32():
    from fasthealth.ops.reference import float32_threshold

    g = torch.Generator().manual_seed(0)
    xs = torch.rand(5000, generator=g, dtype=torch.float64) * 10 ** (
        torch.rand(5000, generator=g, dtype=torch.float64) * 90 - 50)
    xs = xs.tolist() + [0.0, 7.006492321624085e-46, 7.00649232162409e-46, 3.4028235e38,
                        3.4028235677973362e38, 3.4028235677973366e38, 1e39, math.inf]
    for x in xs:
        assert float32_threshold(x, torch.device("cpu")).item() == float(
            torch.tensor(x, dtype=torch.float64).float()), x


def test_missing_extension_warns_and_falls_back():
    code = (
        "import sys, warnings\n"
        "sys.modules['fasthealth._C'] = None\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import fasthealth as fh, torch\n"
        "msgs = [str(x.message) for x in w if 'compiled kernels' in str(x.message)]\n"
        "assert len(msgs) == 1, msgs\n"
        "assert fh.available_backends() == ['torch'], fh.available_backends()\n"
        "s = fh.tensor_stats(torch.tensor([1.0, float('nan')]))\n"
        "assert s.nan_count.item() == 1\n"
        "print('fallback-ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "fallback-ok" in out.stdout


def test_extension_built_for_another_torch_warns_and_falls_back():
    code = (
        "import sys, warnings, torch\n"
        "built = torch.__version__\n"
        "torch.__version__ = '9.9.9'\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import fasthealth as fh\n"
        "msgs = [str(x.message) for x in w if 'compiled kernels' in str(x.message)]\n"
        "assert len(msgs) == 1, msgs\n"
        "assert 'this is torch 9.9.9' in msgs[0], msgs\n"
        "assert fh.available_backends() == ['torch'], fh.available_backends()\n"
        "print('mismatch-ok')\n"
    )
    if "cpu" not in fh.available_backends():
        pytest.skip(f"needs the compiled CPU kernel: {fh.ops.compiled.load_error}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "mismatch-ok" in out.stdout


def test_reference_total_row_matches_the_concatenation():
    """The ``torch`` backend's total row comes from merging per-tensor rows (merge_rows); it
    must equal the reference of all elements concatenated."""
    from cases import random_batch
    from tolerances import check_multi

    ts = random_batch(3, 60, 50_000)
    check_multi(fh.multi_tensor_stats(ts, backend="torch").raw, ts, "torch backend")


def test_sparse_gradients_are_checked_through_their_values():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 8, sparse=True)
    model = torch.nn.Sequential(emb, torch.nn.Linear(8, 1))
    ids = torch.tensor([1, 2, 2, 7])  # a repeated index: coalesced, its rows summed
    model(ids).sum().backward()
    s = fh.check_grads(model)
    dense = emb.weight.grad.to_dense()
    assert s.names == ["0.weight", "1.weight", "1.bias"] and s.ok
    assert s["0.weight"].norm.item() == pytest.approx(dense.norm().item(), rel=1e-6)
    assert s["0.weight"].numel.item() == 3 * 8  # the stored values: rows 1, 2 and 7
    all_dense = [dense] + [p.grad for p in list(model.parameters())[1:]]
    assert s.total.norm.item() == pytest.approx(
        torch.nn.utils.get_total_norm(all_dense).item(), rel=1e-6)
    emb.weight.grad = torch.sparse_coo_tensor([[3]], torch.full((1, 8), float("nan")), (50, 8))
    s = fh.check_grads(model)
    assert s.nonfinite() == ["0.weight"] and s["0.weight"].nan_count.item() == 8
    # the Monitor too: checks, clips (sparse and dense) and skips
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    mon = fh.Monitor(model, opt, max_grad_norm=0.5, flush_every=1)
    mon.step(model(ids).sum().detach())
    assert [e.kind for e in mon.events] == ["nonfinite_grad"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_check_grads_before_backward_warns():
    model = torch.nn.Linear(3, 2)
    with pytest.warns(RuntimeWarning, match="no gradient on any of 2 parameters"):
        s = fh.check_grads(model)
    assert s.missing == ["weight", "bias"] and len(s) == 0 and s.ok


def test_torch_backend_reads_large_tensors_in_pieces(monkeypatch):
    """The reference backend bounds its temporaries by chunking: same answers as one piece."""
    from cases import random_batch
    from tolerances import check_multi

    from fasthealth.ops import reference

    monkeypatch.setattr(reference, "CHUNK", 1000)
    ts = [t for t in random_batch(5, 40, 20_000) if t.numel() > 1000][:12]
    ts.append(torch.randn(30, 70).t())  # non-contiguous, over a chunk
    assert len(ts) > 3
    check_multi(fh.multi_tensor_stats(ts, backend="torch").raw, ts, "chunked torch backend")
    check_multi(fh.multi_tensor_stats(ts, backend="torch", range_dtype=torch.float16).raw, ts,
                "chunked torch backend, range", range_dtype=torch.float16)


def test_check_grads_sees_parameters_replaced_between_calls():
    """The module's parameter list is kept between calls; replacing or adding a parameter, even
    behind the registration hooks, must not leave check_grads on stale tensors."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    m(torch.ones(2, 3)).sum().backward()
    assert len(fh.check_grads(m)) == 4
    m[1].weight = torch.nn.Parameter(torch.zeros(1, 3))  # through setattr: the hook fires
    m[1].weight.grad = torch.full((1, 3), float("nan"))
    assert fh.check_grads(m).nonfinite() == ["1.weight"]
    new = torch.nn.Parameter(torch.zeros(3))  # behind the hooks
    m[0]._parameters["bias"] = new
    new.grad = torch.full((3,), float("inf"))
    assert set(fh.check_grads(m).nonfinite()) == {"0.bias", "1.weight"}
    m[1].extra = torch.nn.Parameter(torch.ones(2))  # a new parameter, no gradient yet
    s = fh.check_grads(m)
    assert s.missing == ["1.extra"] and len(s) == 4
    assert [n for n, _ in m.named_parameters()] == s.names + s.missing


def test_front_door_releases_the_gil_for_large_gradients_and_keeps_them_alive():
    """Gradients over 32 MB are read with the GIL released (csrc/fasthealth.cpp:
    kHoldGilBytes), so other Python threads run during the pass; a thread that drops the
    gradient then cannot free it under the kernel: the statistics are the dropped gradient's.
    A thread waiting for the GIL runs at once when the pass releases it, early in the call;
    held, it would run only after the pass (the switch interval is made long, so Python does
    not hand the GIL over on its own)."""
    import threading
    import time

    _needs_cpu_op()
    from fasthealth import params

    n = 64 * 1024 * 1024  # 256 MB of float32: a pass of several ms
    m = torch.nn.Module()
    m.p = torch.nn.Parameter(torch.zeros(1).expand(n))  # its values are never read
    m.p.grad = torch.full((n,), 2.0)
    fh.check_grads(m)  # keeps the parameter list
    assert params.front_door(m, None, (math.inf, 0.0)) is not None
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    early = []
    try:
        for _ in range(3):
            m.p.grad = torch.full((n,), 2.0)
            go, ran = threading.Event(), []

            def drop(go=go, ran=ran):
                go.wait()
                ran.append(time.perf_counter())
                m.p.grad = None  # the last reference the module held

            t = threading.Thread(target=drop)
            t.start()
            time.sleep(0.01)  # the thread now waits on the event
            t0 = time.perf_counter()
            go.set()
            s = fh.check_grads(m)
            t1 = time.perf_counter()
            t.join()
            assert m.p.grad is None
            if len(s) == 0:  # the thread ran before the gradient was gathered: again
                continue
            assert s.names == ["p"] and int(s["p"].numel) == n
            assert s["p"].min.item() == 2.0 and s["p"].max.item() == 2.0
            early.append(ran[0] - t0 < 0.5 * (t1 - t0))
            if early[-1]:
                break
    finally:
        sys.setswitchinterval(interval)
    assert any(early), "no other thread ran during the pass: the GIL was held"


def test_check_grads_front_door_matches_the_op_and_steps_aside(monkeypatch):
    """On a CPU module, check_grads reads the gradients in one call into the compiled kernel
    (fasthealth/params.py, front_door): its table must equal the op's on the same gradients
    for every dtype and a transposed (dense, not contiguous) gradient; whatever it cannot take
    (a sliced gradient, a missing one, a lazily negated one, backend='torch',
    FASTHEALTH_BACKEND) goes the general path with the same results."""
    _needs_cpu_op()
    from fasthealth import checks, params

    m = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float64,
                               torch.float32]):
        p = torch.nn.Parameter(torch.zeros(70, 30, dtype=dtype))
        p.grad = torch.randn(70, 30, generator=g).to(dtype)
        m.register_parameter(f"p{i}", p)
    m.p0.grad[3, 4] = NAN
    m.p4.grad = torch.randn(30, 70, generator=g).t()  # transposed: read as it lies
    rng = fh.ops.layout.range_thresholds(torch.float16)

    def general(names=None):
        named = [(n, p) for n, p in m.named_parameters() if p.grad is not None]
        return fh.ops.run("cpu", [p.grad for _, p in named], *rng)

    fh.check_grads(m)  # keeps the parameter list
    assert params.front_door(m, None, rng) is not None
    s = fh.check_grads(m, range_dtype=torch.float16)
    assert torch.equal(s.raw.nan_to_num(), general().nan_to_num())
    assert s.nonfinite() == ["p0"] and s.dtypes[1] == torch.bfloat16 and s.missing == []
    check_multi(s.raw, [p.grad for p in m.parameters()], "front door",
                range_dtype=torch.float16)

    calls = []
    real = checks.grads_stats
    monkeypatch.setattr(checks, "grads_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    fh.check_grads(m)
    assert calls == []  # the front door took it
    m.p2.grad = torch.randn(70, 60, generator=g).to(torch.float16)[:, ::2]  # sliced: a copy
    s = fh.check_grads(m, range_dtype=torch.float16)
    assert calls == [1] and torch.equal(s.raw.nan_to_num(), general().nan_to_num())
    # Parameters without a gradient (unused this step; frozen, as in LoRA fine-tuning, with no
    # autograd metadata at all) are skipped and listed, by the front door itself.
    m.p2.grad = None
    m.p3.requires_grad_(False)
    m.p3.grad = None
    s = fh.check_grads(m, range_dtype=torch.float16)
    assert s.missing == ["p2", "p3"] and s.names == ["p0", "p1", "p4"] and len(calls) == 1
    assert torch.equal(s.raw.nan_to_num(), general().nan_to_num())
    assert s.nonfinite() == ["p0"] and s.dtypes == [torch.float32, torch.bfloat16, torch.float32]
    check_multi(s.raw, [m.p0.grad, m.p1.grad, m.p4.grad], "front door, two missing",
                range_dtype=torch.float16)
    m.p2.grad = torch.randn(70, 30, generator=g).to(torch.float16)  # the names split follows
    s = fh.check_grads(m)
    assert s.missing == ["p3"] and s.names == ["p0", "p1", "p2", "p4"] and len(calls) == 1
    assert torch.equal(s.raw.nan_to_num(), general().nan_to_num())
    m.p2.grad = None
    for p in m.parameters():  # none at all: the general path, which warns
        p.grad = None
    with pytest.warns(RuntimeWarning, match="no gradient"):
        assert len(fh.check_grads(m)) == 0
    assert len(calls) == 2
    m.p3.requires_grad_(True)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    m.p1.grad = torch._neg_view(torch.ones(70, 30, dtype=torch.bfloat16))  # a lazy negation
    s = fh.check_grads(m)
    assert len(calls) == 3 and s["p1"].mean.item() == -1.0  # resolved first, never read raw
    m.p1.grad = torch.randn(70, 30, generator=g).to(torch.bfloat16)
    fh.check_grads(m, backend="torch")
    monkeypatch.setenv("FASTHEALTH_BACKEND", "torch")
    fh.check_grads(m)
    assert len(calls) == 5
    monkeypatch.delenv("FASTHEALTH_BACKEND")
    s = fh.check_grads(m)
    assert len(calls) == 5 and s.missing == [] and len(s) == 5


def test_summary_k_limits_the_rows_non_finite_first():
    """k bounds the tensors listed, NaN/Inf ones included: 15 NaN tensors at k=3 list 3."""
    nan = [torch.full((4,), float("nan")) for _ in range(15)]
    text = fh.multi_tensor_stats(nan, names=[f"t{i}" for i in range(15)]).summary(k=3)
    rows = text.splitlines()[2:]
    assert rows[0].startswith("TOTAL") and len(rows) == 4
    assert [r.split()[0] for r in rows[1:]] == ["!t0", "!t1", "!t2"]
    assert "15 tensor(s) with NaN/Inf" in text and "showing 3" in text
    mixed = [torch.full((4,), float(i)) for i in range(6)] + [torch.full((2,), float("inf"))]
    text = fh.multi_tensor_stats(mixed, names=[f"m{i}" for i in range(7)]).summary(k=3)
    assert [r.split()[0] for r in text.splitlines()[3:]] == ["!m6", "m5", "m4"]
