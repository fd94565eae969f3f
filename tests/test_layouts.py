"""CPUOffloadAdamW on every DTensor layout (HSDP, TP, TP x FSDP, EP x FSDP): 4 real gloo ranks.

One launch runs every check (a launch of 4 ranks costs 10-20 s on 2 cores; the models of
tests/_layout_models.py are tiny): per layout, bitwise against ``torch.optim.AdamW(fused=True)``
on the identical model, steps with and without torch's ``clip_grad_norm_`` (whose total norm
``reduce_norm_terms`` must give from local terms); DCP checkpoints saved on one layout and loaded on
another (HSDP 2x2 -> FSDP 4 -> 1 rank, TP2 x FSDP2 -> FSDP 4) equal to torch AdamW's state after
the same save and load; refusals (a ``Partial`` parameter at construction, a ``Partial`` gradient).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from _dist_util import run_workers

STEPS = 4
MAX_NORM = 0.5
LAYOUTS = ("hsdp", "tp4", "tp2-fsdp2", "ep")


def _placements(model: torch.nn.Module) -> set[str]:
    return {repr(tuple(p.placements)) for p in model.parameters()}


def _total_norm_reference(params: list[torch.Tensor], norm_type: float) -> float:
    """The gradient norm over the full (global) gradients, in float64."""
    full = [p.grad.full_tensor().double() for p in params]
    if math.isinf(norm_type):
        return max(float(g.abs().max()) for g in full)
    return float(sum(g.pow(2).sum() for g in full)) ** 0.5


def _ours_norm(params: list[torch.Tensor], norm_type: float) -> float:
    from offload.state._dtensor import local, reduce_norm_terms

    grads = [local(p.grad).double() for p in params]
    if math.isinf(norm_type):
        terms = torch.stack([g.abs().max() if g.numel() else g.new_zeros(()) for g in grads])
        return float(reduce_norm_terms(params, terms, norm_type))
    terms = torch.stack([g.pow(2).sum() for g in grads])
    return float(reduce_norm_terms(params, terms, norm_type)) ** 0.5


def _torch_total(by_mesh: dict[int, list[torch.Tensor]]) -> torch.Tensor:
    """torch's total norm (float32); over several meshes (which torch's clip_grad_norm_ cannot
    stack) torchtitan's way: torch's total per mesh, combined."""
    per_mesh = [torch.nn.utils.get_total_norm([p.grad for p in ps], foreach=True) for ps in by_mesh.values()]
    per_mesh = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in per_mesh]
    return per_mesh[0] if len(per_mesh) == 1 else torch.linalg.vector_norm(torch.stack(per_mesh))


def _clip(params: list[torch.Tensor], norms: list[dict[str, float]], opt: Any, how: str,
          given: list[torch.Tensor]) -> None:
    """Clip the gradients ``how``: "torch" (torch's clip_grad_norm_, or its total norm and
    scaling per mesh where the parameters span meshes), "ours" (``opt.clip_grad_norm_``, whose
    total norm is appended to ``given``), "given" (torch's scaling by the next total of ``given``).
    Each time ``reduce_norm_terms``' norms are checked against torch's and the full gradients'."""
    ours = {t: _ours_norm(params, t) for t in (2.0, math.inf)}
    ref = {t: _total_norm_reference(params, t) for t in (2.0, math.inf)}
    by_mesh: dict[int, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(id(p.device_mesh), []).append(p)
    total = _torch_total(by_mesh)
    entry = {"torch": float(total), "ours2": ours[2.0], "ref2": ref[2.0], "oursinf": ours[math.inf],
             "refinf": ref[math.inf]}
    if how == "ours":
        given.append(opt.clip_grad_norm_(MAX_NORM))
        entry["opt"] = float(given[-1])
    elif how == "torch" and len(by_mesh) == 1:
        clipped = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        assert float(clipped.full_tensor() if hasattr(clipped, "full_tensor") else clipped) == float(total)
    else:
        norm = total if how == "torch" else given[len(norms)]
        for ps in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(ps, MAX_NORM, norm, foreach=True)
    norms.append(entry)


def _train(model: torch.nn.Module, opt: Any, data_rank: int, steps: range, clip: str | None,
           norms: list[dict[str, float]], given: list[torch.Tensor] | None = None) -> None:
    from _layout_models import batch

    for step in steps:
        model(*batch(data_rank, step), step).backward()
        if clip and step % 2:  # clipped and unclipped steps in one run
            _clip(list(model.parameters()), norms, opt, clip, given if given is not None else [])
        opt.step()
        if getattr(opt, "last_stats", None) is not None:
            norms_stats = getattr(opt, "test_stats", [])
            opt.test_stats = [*norms_stats, (opt.last_stats.speculated_chunks, opt.last_stats.committed_chunks)]
        opt.zero_grad(set_to_none=True)


def _ours(model: torch.nn.Module, **kw: Any) -> Any:
    from _layout_models import groups
    from offload import CPUOffloadAdamW, OffloadSettings

    return CPUOffloadAdamW(groups(model), lr=1e-3, settings=OffloadSettings(threads=1, chunk_numel=1024), **kw)


def _torch(model: torch.nn.Module) -> Any:
    from _layout_models import groups

    return torch.optim.AdamW(groups(model), lr=1e-3, fused=True)


def _state(model: torch.nn.Module, opt: Any) -> list[torch.Tensor]:
    from offload.state._dtensor import local

    out = [local(p).detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [local(opt.state[p][k]).detach().clone() for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


def _check_numerics(rank: int, checked: list[str], figures: dict[str, Any]) -> None:
    from _fsdp_models import assert_same
    from _layout_models import build
    from offload.state._dtensor import layout_of, local_part_of

    for kind in LAYOUTS:
        # overlap off, torch's clip_grad_norm_ on odd steps: bitwise torch's AdamW
        ref, data_rank = build(kind)
        ref_opt = _torch(ref)
        ref_norms: list[dict[str, float]] = []
        _train(ref, ref_opt, data_rank, range(STEPS), "torch", ref_norms)
        model, _ = build(kind)
        opt = _ours(model)
        norms: list[dict[str, float]] = []
        _train(model, opt, data_rank, range(STEPS), "torch", norms)
        assert_same(_state(model, opt), _state(ref, ref_opt), kind)
        assert norms == ref_norms, (kind, norms, ref_norms)  # the same gradients, step after step
        opt.close()
        # overlap on, our clip_grad_norm_: bitwise torch's AdamW after torch's scaling by our norm
        model, _ = build(kind)
        opt = _ours(model, overlap_backward=True)
        given: list[torch.Tensor] = []
        _train(model, opt, data_rank, range(STEPS), "ours", norms, given)
        # chunks really started during backward; committed on the unclipped steps, redone on the clipped
        spec = opt.test_stats
        assert all(sp > 0 for sp, _ in spec[1:]) and any(c > 0 for _, c in spec), (kind, spec)
        figures[f"{kind} overlap (speculated, committed) per step"] = spec
        ref, _ = build(kind)
        ref_opt = _torch(ref)
        _train(ref, ref_opt, data_rank, range(STEPS), "given", [], given)
        assert_same(_state(model, opt), _state(ref, ref_opt), f"{kind} overlap")
        for n in norms:
            for ours, ref_value in ((n["ours2"], n["torch"]), (n["ours2"], n["ref2"]), (n["oursinf"], n["refinf"]),
                                   (n.get("opt", n["torch"]), n["torch"])):
                assert abs(ours - ref_value) <= 1e-6 * ref_value, (kind, n)
        assert len(norms) == STEPS and all(n["torch"] > MAX_NORM for n in norms), (kind, norms)  # clipped
        figures[f"{kind} norm rel diff"] = max(max(abs(n["ours2"] - n["torch"]), abs(n.get("opt", n["torch"]) - n["torch"]))
                                               / n["torch"] for n in norms)
        figures.setdefault("placements", {})[kind] = sorted(_placements(model))
        for i, p in enumerate(model.parameters()):  # the local part of a whole tensor, by layout
            part = local_part_of(p.full_tensor(), layout_of(p, f"parameter {i}"))
            assert torch.equal(part, p.to_local()), (kind, i, p.placements)
        if kind == "ep":
            assert 0 in model.idle and max(model.idle) >= 2, model.idle  # experts without tokens on some steps
        opt.close()
        checked += [kind, f"{kind} overlap"]


def _dcp(model: torch.nn.Module, opt: Any, path: Path, load: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if not load:
        dcp.save(sd, checkpoint_id=str(path))
        return
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def _check_checkpoints(rank: int, root: Path, checked: list[str]) -> None:
    """Save on one layout, load on the next: our state equals torch AdamW's after the same
    save and load (and both continue equal)."""
    from torch.distributed.tensor import DTensor

    from _fsdp_models import assert_same
    from _layout_models import build

    for chain in (("hsdp", "fsdp4", "single"), ("tp2-fsdp2", "fsdp4")):
        pair = {}
        for name, make in (("torch", _torch), ("ours", _ours)):
            model, data_rank = build(chain[0])
            opt = make(model)
            _train(model, opt, data_rank, range(STEPS), None, [])
            if name == "ours":
                entry = next(iter(opt.state_dict()["state"].values()))
                assert isinstance(entry["exp_avg"], DTensor), type(entry["exp_avg"])
                assert entry["exp_avg"].placements == next(model.parameters()).placements
                assert entry["exp_avg"].shape == next(model.parameters()).shape
            pair[name] = (model, opt, data_rank)
        for i, kind in enumerate(chain):
            for name in pair:
                _dcp(pair[name][0], pair[name][1], root / f"{'-'.join(chain)}-{i}-{name}", load=False)
            if i + 1 == len(chain):
                break
            for name, make in (("torch", _torch), ("ours", _ours)):
                if name == "ours":
                    pair[name][1].close()
                model, data_rank = build(chain[i + 1])
                opt = make(model)
                _dcp(model, opt, root / f"{'-'.join(chain)}-{i}-{name}", load=True)
                pair[name] = (model, opt, data_rank)
            what = f"dcp {kind} -> {chain[i + 1]}"
            (model, opt, data_rank), (ref, ref_opt, _) = pair["ours"], pair["torch"]
            assert_same(_state(model, opt), _state(ref, ref_opt), what)
            assert all(float(opt.state[p]["step"]) == STEPS + i for p in model.parameters())
            assert any(bool(opt.state[p]["exp_avg_sq"].ne(0).any()) for p in model.parameters())
            _train(model, opt, data_rank, range(STEPS + i, STEPS + i + 1), None, [])
            _train(ref, ref_opt, data_rank, range(STEPS + i, STEPS + i + 1), None, [])
            assert_same(_state(model, opt), _state(ref, ref_opt), f"{what} continued")
            checked.append(what)
        pair["ours"][1].close()


def _check_refusals(rank: int, checked: list[str]) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from _layout_models import mesh
    from offload import CPUOffloadAdamW
    from offload.state._params import ParamRegistry, check_grad

    m = mesh("tp4")
    bad = torch.nn.Parameter(DTensor.from_local(torch.zeros(6), m, [Partial()], run_check=False))
    try:
        CPUOffloadAdamW([("good", torch.nn.Parameter(torch.zeros(3))), ("bad.weight", bad)])
    except ValueError as exc:
        assert "parameter 1 ('bad.weight')" in str(exc) and "Partial" in str(exc), str(exc)
    else:
        raise AssertionError("a Partial parameter: no ValueError at construction")
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(6), m, [Replicate()], run_check=False))
    reg = ParamRegistry([{"params": [p], "param_names": ["w"]}])
    check_grad(reg[0], DTensor.from_local(torch.ones(6), m, [Replicate()], run_check=False))
    for grad, needle in ((DTensor.from_local(torch.ones(6), m, [Partial()], run_check=False), "Partial"),
                         (torch.ones(6), "plain Tensor")):
        try:
            check_grad(reg[0], grad)
        except RuntimeError as exc:
            assert "parameter 0 ('w')" in str(exc) and needle in str(exc), str(exc)
        else:
            raise AssertionError(f"{needle} gradient: no RuntimeError")
    # A DTensor state of another layout with the same local size: refused, not loaded silently.
    from torch.distributed.tensor import Shard

    opt = CPUOffloadAdamW([p])
    p.grad = DTensor.from_local(torch.ones(6), m, [Replicate()], run_check=False)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = DTensor.from_local(torch.zeros(6), m, [Shard(0)], run_check=False)
    try:
        opt.load_state_dict(sd)
    except ValueError as exc:
        assert "placements (Shard(dim=0),)" in str(exc) and "expected the parameter's (Replicate(),)" in str(exc), str(exc)
    else:
        raise AssertionError("a DTensor state of another layout: no ValueError")
    opt.close()
    checked.append("refusals")


def _layouts_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    import time

    checked: list[str] = []
    figures: dict[str, Any] = {}
    t0 = time.perf_counter()
    _check_refusals(rank, checked)
    t1 = time.perf_counter()
    _check_numerics(rank, checked, figures)
    t2 = time.perf_counter()
    _check_checkpoints(rank, Path(root), checked)
    figures["seconds"] = {"refusals": t1 - t0, "numerics": t2 - t1, "checkpoints": time.perf_counter() - t2}
    return {"checked": checked, "figures": figures}


@pytest.mark.slow
def test_layouts_bitwise_equal_to_torch_and_reshard_through_dcp(tmp_path: Path) -> None:
    results = run_workers(_layouts_worker, world_size=4, kwargs={"root": str(tmp_path)}, timeout_s=600)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    required = {"refusals"} | set(LAYOUTS) | {f"{k} overlap" for k in LAYOUTS}
    required |= {"dcp hsdp -> fsdp4", "dcp fsdp4 -> single", "dcp tp2-fsdp2 -> fsdp4"}
    for r in results:
        assert required <= set(r.value["checked"]), (required - set(r.value["checked"]))
    placements = results[0].value["figures"]["placements"]
    assert "(Replicate(), Shard(dim=0))" in placements["hsdp"], placements
    assert {"(Shard(dim=1),)", "(Replicate(),)"} <= set(placements["tp4"]), placements
    assert any("_StridedShard" in p for p in placements["tp2-fsdp2"]), placements
