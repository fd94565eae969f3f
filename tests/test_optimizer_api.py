"""CPUOffloadAdamW as a torch.optim.Optimizer: validation, stats, threads, worker, state_dict."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading

import pytest
import torch
import torch.nn as nn
from conftest import batch, make_model, param_groups

from offload import CPUOffloadAdamW, OffloadSettings, StepStats
from offload.testing import KernelSet
from offload.kernels._adamw import fused_adamw_
from offload.state._slabs import _ALIGN, plan_chunks

pytestmark = pytest.mark.usefixtures("single_threaded_main")


def _params(n: int = 3) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(5, 7)) for _ in range(n)]


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"amsgrad": True}, "amsgrad=True"),
        ({"maximize": True}, "maximize=True"),
        ({"capturable": True}, "capturable=True"),
        ({"differentiable": True}, "differentiable=True"),
        ({"foreach": True}, "foreach=True"),
        ({"fused": False}, "fused=False"),
        ({"lr": -1e-3}, "lr=-0.001"),
        ({"lr": float("nan")}, "lr=nan"),
        ({"lr": torch.tensor([1e-3, 2e-3])}, "lr="),
        ({"betas": (1.0, 0.999)}, r"betas\[0\]=1.0"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]=-0.1"),
        ({"betas": (0.9,)}, r"betas=\(0.9,\)"),
        ({"eps": -1e-8}, "eps=-1e-08"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
    ],
)
def test_invalid_options_raise_value_error_naming_them(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CPUOffloadAdamW(_params(), **kwargs)


def test_invalid_option_in_a_param_group_is_rejected() -> None:
    ps = _params()
    with pytest.raises(ValueError, match="amsgrad=True in param group 1"):
        CPUOffloadAdamW([{"params": ps[:1]}, {"params": ps[1:], "amsgrad": True}])
    with pytest.raises(ValueError, match="lr=-1 in param group 1"):
        CPUOffloadAdamW([{"params": ps[:1]}, {"params": ps[1:], "lr": -1}])


def test_unsupported_option_error_says_what_the_step_runs() -> None:
    with pytest.raises(ValueError) as info:
        CPUOffloadAdamW([nn.Parameter(torch.zeros(4))], amsgrad=True)
    text = str(info.value)
    assert "amsgrad=True" in text and "always runs torch's" not in text and "fused-mp" in text, text


@pytest.mark.parametrize(
    ("param", "match"),
    [
        (torch.zeros(4, dtype=torch.int64), "dtype torch.int64"),
        (torch.zeros(4, dtype=torch.float64, requires_grad=True), "dtype torch.float64"),
        (torch.zeros(4, dtype=torch.complex64, requires_grad=True), "dtype torch.complex64"),
        (torch.zeros(4, 4).to_sparse().requires_grad_(), "layout torch.sparse_coo"),
        (torch.zeros(4, 6)[:, ::2].requires_grad_(), "does not cover one dense block of memory"),
        (torch.zeros(4, device="meta", requires_grad=True), "on meta"),
    ],
)
def test_unsupported_parameters_raise_value_error(param: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CPUOffloadAdamW([nn.Parameter(torch.zeros(3)), param])


def test_other_construction_errors() -> None:
    p = _params(1)
    with pytest.raises(ValueError):
        CPUOffloadAdamW([])
    with pytest.raises(ValueError, match="appears twice"):
        CPUOffloadAdamW([p[0], p[0]])
    with pytest.raises(TypeError, match="autotune"):
        CPUOffloadAdamW(p, autotune={"probe_steps": 10})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="settings"):
        CPUOffloadAdamW(p, settings={"threads": 2})  # type: ignore[arg-type]
    opt = CPUOffloadAdamW(p, foreach=False, fused=True)  # the accepted spellings
    assert opt.tuner is None
    opt.add_param_group({"params": _params(1)})  # numerics: tests/test_add_param_group.py
    assert len(opt.param_groups) == 2
    with pytest.raises(ValueError, match="float64"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.float64))]})
    assert len(opt.param_groups) == 2  # a rejected group leaves the optimizer as it was
    with pytest.raises(TypeError, match="OffloadSettings"):
        opt.apply_settings({"threads": 1})  # type: ignore[arg-type]
    opt.close()


FLOAT64_REASON = (r"has dtype torch\.float64: expected one of \(torch\.float32, torch\.bfloat16, torch\.float16\) "
                  r"\(the masters and moments are float32, so a torch\.float64 parameter would be stepped in "
                  r"float32, not as torch's AdamW steps it\): step it with torch\.optim\.AdamW")


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float64_parameters_are_refused_with_the_reason(dtype: torch.dtype, overlap: bool) -> None:
    """At construction, in add_param_group, and at the step after ``.data`` became float64
    (``model.double()``; a bf16 parameter was stepped in float32 then), before anything is written."""
    with pytest.raises(ValueError, match=r"parameter 1 \('1\.weight'\) " + FLOAT64_REASON):
        CPUOffloadAdamW(nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False).double())
                        .named_parameters())
    model = nn.Linear(4, 3).to(dtype)
    opt = CPUOffloadAdamW(model.parameters(), overlap_backward=overlap)
    with pytest.raises(ValueError, match="parameter 2 in param group 1 " + FLOAT64_REASON):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.float64))]})
    for _ in range(2):
        model(torch.ones(2, 4, dtype=dtype)).sum().backward()
        opt.step()
    model.double()
    before = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    refused = r"parameter \d \(its \.data was replaced since the last step\) " + FLOAT64_REASON
    if overlap:  # the backward hook that would start the chunk early refuses it
        with pytest.raises(ValueError, match=refused):
            model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    else:
        model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match=refused):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), moments))
    assert all(opt.state[p]["step"].item() == 2.0 for p in model.parameters())
    opt.close()


def test_sparse_gradient_raises_at_step() -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = CPUOffloadAdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()
    opt.close()


# ------------------------------------------------------------------------------ chunking
@pytest.mark.parametrize("chunk_numel", [64, 100, 1024, 1500, 1 << 20])
def test_chunks_cover_every_element_once_aligned_and_within_groups(chunk_numel: int) -> None:
    from offload.state._slabs import HostSlabs

    shapes = [[torch.Size([37, 48]), torch.Size([133]), torch.Size([1]), torch.Size([6384])],
              [torch.Size([5, 3]), torch.Size([2000])]]
    slabs = HostSlabs(shapes)
    chunks = plan_chunks(list(slabs.slots), chunk_numel)
    covered = {s.index: [] for s in slabs.slots}
    for c in chunks:
        assert c.numel <= chunk_numel
        for v in c.views:
            slot = slabs.slots[v.slot]
            assert slot.group == c.group
            assert v.start % _ALIGN == 0
            assert v.stop == slot.numel or v.numel % _ALIGN == 0
            covered[v.slot].append((v.start, v.stop))
    for s in slabs.slots:
        ranges = sorted(covered[s.index])
        assert ranges[0][0] == 0 and ranges[-1][1] == s.numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert slabs.flat("master", s.index).data_ptr() % 64 == 0


# ------------------------------------------------------------------------------ torch.optim API
def test_behaves_as_a_torch_optimizer() -> None:
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model), lr=1e-3)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults["lr"] == 1e-3 and len(opt.param_groups) == 3
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(batch(0)).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.5e-3)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())

    sd = opt.state_dict()
    p0 = model.emb.weight
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}  # torch AdamW's keys: fp32, the weight is the master
    assert st["exp_avg"].shape == p0.shape and st["exp_avg"].dtype == torch.float32
    assert st["step"].dtype == torch.float32 and st["step"].item() == 1.0
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(batch(1))
        loss.backward()
        return loss

    with torch.no_grad():  # torch runs the closure with grad enabled
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert opt.state[p0]["step"].item() == 2.0
    opt.close()


def _torch_save_and_load(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps, _torch_save_and_load,
                                 lambda opt: copy.deepcopy({"optimizer": opt})],
                         ids=["copy", "deepcopy", "pickle", "torch.save", "deepcopy-of-a-dict"])
def test_copying_the_optimizer_raises_and_says_how_to_checkpoint(how) -> None:
    """torch's Optimizer pickles defaults, state and param_groups only: a copy of ours had no slabs
    or worker, and its step() raised AttributeError '_in_step' far from the copy."""
    model = make_model()
    opt = CPUOffloadAdamW(model.parameters(), overlap_backward=True)
    model(batch(0)).backward()
    with pytest.raises(TypeError, match=r"CPUOffloadAdamW cannot be copied, pickled or saved whole .*"
                                         r"checkpoint opt\.state_dict\(\) .* load_state_dict\(\) it into a new"):
        how(opt)
    twin = copy.deepcopy(model)  # the backward hooks hold the optimizer weakly: models still copy
    opt.step()  # the refused copy left the optimizer as it was
    sd = _torch_save_and_load(opt.state_dict())  # what the message says to do
    other = CPUOffloadAdamW(twin.parameters(), overlap_backward=True)
    other.load_state_dict(sd)
    assert other.state[twin.emb.weight]["step"].item() == 1.0
    opt.close()
    other.close()


def test_load_state_dict_rejects_mismatches() -> None:
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model))
    model(batch(0)).backward()
    opt.step()
    sd = opt.state_dict()
    other = CPUOffloadAdamW(list(model.parameters()))
    with pytest.raises(ValueError, match="parameter groups"):
        other.load_state_dict(sd)
    bad = {**sd, "param_groups": [{**g} for g in sd["param_groups"]]}
    bad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad=True in loaded param group 0"):
        opt.load_state_dict(bad)
    bad = {**sd, "state": {**sd["state"], 0: {**sd["state"][0], "exp_avg": torch.zeros(3)}}}
    with pytest.raises(ValueError, match="has 3 elements"):
        opt.load_state_dict(bad)
    opt.close()
    other.close()


# ------------------------------------------------------------------------------ stats
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_step_stats_are_consistent(dtype) -> None:
    """bf16 on the torch kernel has all three stages; an fp32 CPU model only the kernel (it reads
    the gradient and writes the parameter in place: no copies)."""
    model = make_model(dtype)
    opt = CPUOffloadAdamW(param_groups(model),
                          settings=OffloadSettings(chunk_numel=1024, threads=1, kernel="torch"))
    assert opt.last_stats is None
    model(batch(0)).backward()
    opt.step()
    stats = opt.last_stats
    assert isinstance(stats, StepStats)
    for name in ("step_s", "d2h_s", "adam_kernel_s", "materialize_s", "drain_s"):
        assert getattr(stats, name) >= 0.0, name
    assert stats.drain_s <= stats.step_s
    with_grad = [p for p in model.parameters() if p.grad is not None]
    assert stats.numel == sum(p.numel() for p in with_grad)
    assert stats.threads == 1 and stats.chunk_numel == 1024
    assert stats.num_chunks == len({s.chunk for s in stats.spans}) > 10
    by_chunk: dict[int, dict[str, tuple[float, float]]] = {}
    for s in stats.spans:
        assert 0.0 <= s.start_s <= s.end_s <= stats.step_s
        by_chunk.setdefault(s.chunk, {})[s.stage] = (s.start_s, s.end_s)
    for stages in by_chunk.values():
        if dtype == torch.float32:
            assert set(stages) == {"adam_kernel"}
            continue
        assert set(stages) == {"d2h", "adam_kernel", "materialize"}
        assert stages["d2h"][1] <= stages["adam_kernel"][0]
        assert stages["adam_kernel"][1] <= stages["materialize"][0]
    total = {st: sum(s.end_s - s.start_s for s in stats.spans if s.stage == st)
             for st in ("d2h", "adam_kernel", "materialize")}
    assert total["adam_kernel"] == pytest.approx(stats.adam_kernel_s)
    assert total["d2h"] == pytest.approx(stats.d2h_s)
    opt.close()


# ------------------------------------------------------------------------------ threads / worker
def test_kernel_runs_on_the_worker_with_the_configured_intra_op_threads() -> None:
    calls: list[tuple[int, bool]] = []

    def spy(*args, **kwargs):
        calls.append((torch.get_num_threads(), threading.current_thread() is threading.main_thread()))
        return fused_adamw_(*args, **kwargs)

    main_before = torch.get_num_threads()
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(threads=3, kernel="torch"),
                          kernels=KernelSet(fused_adamw=spy))
    for step, threads in enumerate((3, 1, 2)):
        opt.apply_settings(OffloadSettings(threads=threads, kernel="torch"))
        calls.clear()
        opt.zero_grad()
        model(batch(step)).backward()
        opt.step()
        assert calls and all(c == (threads, False) for c in calls)
        assert torch.get_num_threads() == main_before
    # the worker restored its count: a new thread still starts with the process default
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [main_before]
    opt.close()


def test_threads_default_comes_from_the_thread_plan() -> None:
    from offload import plan_cpu_threads
    from offload.testing import CpuTopology

    plan = plan_cpu_threads(threads=5, topology=CpuTopology.from_cores([[c] for c in range(8)]), cpus=range(8))
    opt = CPUOffloadAdamW(_params(), plan=plan)
    assert opt.settings.threads == 5
    opt.apply_settings(OffloadSettings(threads=None, chunk_numel=2048))
    assert opt.settings == OffloadSettings(threads=5, chunk_numel=2048, kernel=opt.settings.kernel)
    opt.close()


def test_a_plan_and_explicit_threads_are_refused_together() -> None:
    from offload import plan_cpu_threads

    with pytest.raises(ValueError, match=r"settings.threads=2 and plan=\.\.\.: pass one of them"):
        CPUOffloadAdamW(_params(), settings=OffloadSettings(threads=2), plan=plan_cpu_threads(threads=1))
    with pytest.raises(TypeError, match="plan=3: expected an offload.ThreadPlan"):
        CPUOffloadAdamW(_params(), plan=3)  # type: ignore[arg-type]


def test_worker_exception_reaches_step_and_the_worker_survives() -> None:
    calls = []

    def boom(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected kernel failure")
        return fused_adamw_(*args, **kwargs)

    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(chunk_numel=1024, kernel="torch"),
                          kernels=KernelSet(fused_adamw=boom))
    model(batch(0)).backward()
    checkpoint = opt.state_dict()  # before any step: empty
    with pytest.raises(MemoryError, match="injected"):
        opt.step()
    assert len(calls) == 3  # the chunks after the failing one were not touched
    # The failing call may have written part of its chunk, and a parameter spans it: refused
    # (tests/test_interrupted_step.py has every point and the exactness after recovering).
    for call in (opt.step, opt.state_dict):
        with pytest.raises(RuntimeError, match=r"part-stepped \(.*load_state_dict\(\)"):
            call()
    opt.load_state_dict(checkpoint)
    opt.step()  # the worker is still alive and serves the next step
    assert opt.last_stats is not None and opt.last_stats.num_chunks > 3
    opt.close()


def test_worker_thread_stops_on_close_and_on_garbage_collection() -> None:
    def workers() -> int:
        return sum(t.name.startswith("offload-adamw-") for t in threading.enumerate())

    before = workers()
    opt = CPUOffloadAdamW(_params())
    assert workers() == before + 1
    opt.close()
    assert workers() == before
    opt = CPUOffloadAdamW(_params())
    assert workers() == before + 1
    del opt
    gc.collect()
    assert workers() == before


def test_meta_parameters_are_refused_saying_to_build_after_to_empty() -> None:
    """Deferred initialisation (parameters on ``meta``): a clear error at construction saying
    when to build the optimizer, and the recipe it names works."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"meta device \(deferred initialisation\): build CPUOffloadAdamW after model.to_empty"):
        CPUOffloadAdamW(model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    opt = CPUOffloadAdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.close()


def test_a_state_key_that_is_not_a_parameter_passes_through_state_dict_as_torch_keeps_it() -> None:
    """torch's own test_state_dict_pre_hook puts ``optimizer.state["test"] = 1``: torch's
    ``state_dict()`` returns the key unchanged, and so must ours (it raised TypeError)."""
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model))
    ref = torch.optim.AdamW(param_groups(make_model()), fused=True)
    for o, m in ((opt, model), (ref, None)):
        if m is not None:
            m(batch(0)).backward()
            o.step()
        o.state["test"] = 1
    ours, theirs = opt.state_dict(), ref.state_dict()
    assert ours["state"]["test"] == theirs["state"]["test"] == 1
    assert all(isinstance(k, int) for k in ours["state"] if k != "test")
    opt.close()


def test_state_dict_post_hooks_see_and_may_replace_the_dict_returned() -> None:
    """As torch's ``state_dict()`` runs them: a post-hook gets the dict that is returned (ours is
    converted to torch's shape first: a bf16 parameter's ``master_param``, int keys), and what
    a hook returns replaces it; pre-hooks run once, before."""
    model = make_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model))
    model(batch(0)).backward()
    opt.step()
    calls: list[str] = []
    seen: list[dict] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: (calls.append("post"), seen.append(sd)) and None)
    sd = opt.state_dict()
    assert calls == ["pre", "post"]
    assert seen[0] is sd
    assert all("master_param" in entry for entry in sd["state"].values())
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    assert opt.state_dict()["extra"] == 1
    opt.close()


def test_betas_mixing_a_float_and_a_tensor_are_refused_as_torch_refuses_them() -> None:
    for betas in ((0.9, torch.tensor(0.999)), (torch.tensor(0.9), 0.999)):
        with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
            torch.optim.AdamW([nn.Parameter(torch.zeros(2))], betas=betas)
        with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
            CPUOffloadAdamW([nn.Parameter(torch.zeros(2))], betas=betas)


def test_the_packages_export_user_names_and_testing_holds_the_seams() -> None:
    """``offload.__all__`` holds at most twelve names, those a user of ``CPUOffloadAdamW``,
    ``tune_step_threads`` and ``tune_deepspeed`` needs; the injection seams are in
    ``offload.testing`` and ``autotune.testing`` and nowhere in ``__all__``; a name that moved
    there raises an AttributeError that says where it went (docs/architecture.md, "API and seams")."""
    import autotune
    import autotune.testing
    import offload
    import offload.testing

    assert len(offload.__all__) <= 12, f"offload.__all__ has {len(offload.__all__)} names: {offload.__all__}"
    for module in (offload, offload.testing, autotune, autotune.testing):
        assert [n for n in module.__all__ if not hasattr(module, n)] == [], module.__name__
    assert not set(offload.testing.__all__) & set(offload.__all__)
    assert not set(autotune.testing.__all__) & set(autotune.__all__)
    assert set(offload.__all__) <= set(dir(offload)) and not set(offload.testing.__all__) & set(dir(offload))
    for name in offload.testing.__all__:
        with pytest.raises(AttributeError, match=rf"^offload\.{name} moved to offload\.testing\.{name} .*"
                                                 rf"from offload\.testing import {name}$"):
            getattr(offload, name)
    with pytest.raises(AttributeError, match=r"^autotune\.InProcessAgreement moved to autotune\.testing\."):
        getattr(autotune, "InProcessAgreement")
    with pytest.raises(AttributeError, match=r"module 'offload' has no attribute 'NoSuchName'"):
        getattr(offload, "NoSuchName")
    from offload import DeepSpeedTuning, StageSpan  # the types of returned values, outside __all__

    assert {StageSpan.__name__, DeepSpeedTuning.__name__} <= set(dir(offload))


def test_the_testing_modules_have_no_side_effects_at_import() -> None:
    """``import offload.testing`` / ``autotune.testing`` after ``import offload`` loads nothing but
    themselves and the module that defines ``InProcessAgreement``, and changes no environment
    variable, thread count or logging handler."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import logging, os, sys, torch\n"
            "import offload\n"
            "before = (set(sys.modules), dict(os.environ), torch.get_num_threads(), torch.get_num_interop_threads(),\n"
            "          list(logging.getLogger().handlers), logging.getLogger().level)\n"
            "import offload.testing, autotune.testing\n"
            "after = (set(sys.modules), dict(os.environ), torch.get_num_threads(), torch.get_num_interop_threads(),\n"
            "         list(logging.getLogger().handlers), logging.getLogger().level)\n"
            "assert after[0] - before[0] == {'offload.testing', 'autotune.testing', 'autotune.agree._inprocess'}, "
            "after[0] - before[0]\n"
            "assert after[1:] == before[1:], (before[1:], after[1:])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).absolute().parents[1], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
