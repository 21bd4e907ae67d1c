"""The decode model against cited public measurements (issue 40).

:mod:`plexrl_dask.sim.decode` prices a decode step from datasheet constants and an estimated
MBU. This module checks it: ``sim/workloads/decode-measurements.yaml`` holds published decode
measurements (engine, GPU, tensor-parallel degree, batch, lengths, the number as printed, its
source), and :func:`compare_measured` evaluates the same
:class:`~plexrl_dask.sim.decode.DecodeModel` at each point: a workload's ``hardware:`` (MBU,
decode MFU, step overhead) on the point's GPU (HBM size and bandwidth, bf16 peak: the compute
term of FP8 points is priced at the bf16 peak too), the point's model shape with its bytes per
weight and per KV element, at the point's batch per replica, context and ``tp``. The model has
no tensor-parallel communication term.

Each point's measurement becomes one sequence's decode rate (tokens/s) and the replica's output
tokens/s per GPU; the ratio is predicted ÷ measured (the same for both: batch and ``tp`` are
the point's). Above 1 the model is optimistic, below 1 pessimistic.

Pure numpy; no Dask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from plexrl_dask.errors import InvalidTrace
from plexrl_dask.sim.decode import DecodeModel, Hardware, LengthModel, ModelShape, _positive
from plexrl_dask.sim.workload import WORKLOADS

MEASUREMENTS = WORKLOADS / "decode-measurements.yaml"

#: What a measurement is, and how it becomes one sequence's tokens/s at (batch, tp).
KINDS = {
    "per_sequence_tok_s": lambda v, batch, tp: v,
    "itl_ms": lambda v, batch, tp: 1e3 / v,
    "tpot_ms": lambda v, batch, tp: 1e3 / v,
    "total_output_tok_s": lambda v, batch, tp: v / batch,
    "output_tok_s_per_gpu": lambda v, batch, tp: v * tp / batch,
}
_GPU_KEYS = ("hbm_gb", "hbm_tbps", "bf16_tflops")


@dataclass(frozen=True)
class MeasuredPoint:
    """One published measurement (the data file's header says what each field means)."""

    name: str
    model: str
    shape: ModelShape
    engine: str
    gpu: str
    tp: int
    batch: int
    context: float  # tokens: isl + osl / 2 unless the file gives it
    value: float
    printed: str
    kind: str
    source: str

    @property
    def per_sequence_tok_s(self) -> float:
        """The measurement as one sequence's decode rate."""
        return float(KINDS[self.kind](self.value, self.batch, self.tp))


def _number(where: str, key: str, v) -> float:
    if isinstance(v, bool):  # (decode's check takes bools for ints)
        raise InvalidTrace(f"{where}: {key} must be a finite number > 0, got {v!r}")
    _positive(where, **{key: v})
    return float(v)


def _integer(where: str, key: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidTrace(f"{where}: {key} must be an integer >= 1, got {v!r}")
    return v


def _point(d, gpus: dict[str, dict[str, float]], i: int) -> MeasuredPoint:
    if not isinstance(d, dict):
        raise InvalidTrace(f"measured point {i}: not a mapping")
    where = f"measured point {d.get('name', i)!r}"
    for key in ("name", "model", "engine", "source", "gpu"):
        if not isinstance(d.get(key), str) or not d[key].strip():
            raise InvalidTrace(f"{where}: {key} must be a non-empty string")
    if d["gpu"] not in gpus:
        raise InvalidTrace(f"{where}: gpu {d['gpu']!r} is not one of gpus: {sorted(gpus)}")
    shape_d = d.get("shape")
    if not isinstance(shape_d, dict) or "params_b" not in shape_d:
        raise InvalidTrace(f"{where}: shape must be a mapping with params_b")
    shape = ModelShape.from_dict(shape_d, _number(where, "params_b", shape_d["params_b"]))
    tp = _integer(where, "tp", d.get("tp"))
    batch = _integer(where, "batch", d.get("batch"))
    if "context" in d:
        context = _number(where, "context", d["context"])
    elif "isl" in d and "osl" in d:
        context = _number(where, "isl", d["isl"]) + _number(where, "osl", d["osl"]) / 2
    else:
        raise InvalidTrace(f"{where}: needs isl and osl, or context")
    m = d.get("measured")
    if not isinstance(m, dict):
        raise InvalidTrace(f"{where}: measured must be a mapping (value, printed, kind)")
    if m.get("kind") not in KINDS:
        raise InvalidTrace(f"{where}: measured kind must be one of {sorted(KINDS)}")
    if not isinstance(m.get("printed"), str) or not m["printed"].strip():
        raise InvalidTrace(f"{where}: measured printed must be the number's text as printed")
    return MeasuredPoint(
        name=d["name"],
        model=d["model"],
        shape=shape,
        engine=d["engine"],
        gpu=d["gpu"],
        tp=tp,
        batch=batch,
        context=context,
        value=_number(where, "measured value", m.get("value")),
        printed=m["printed"],
        kind=m["kind"],
        source=d["source"],
    )


def parse_measurements(d) -> tuple[dict[str, dict[str, float]], list[MeasuredPoint]]:
    """The data file's contents (as loaded from YAML): its GPUs and its points."""
    if not isinstance(d, dict) or not isinstance(d.get("gpus"), dict):
        raise InvalidTrace("measurements: needs gpus: (name to hbm_gb, hbm_tbps, bf16_tflops)")
    gpus: dict[str, dict[str, float]] = {}
    for name, g in d["gpus"].items():
        if not isinstance(g, dict) or set(g) != set(_GPU_KEYS):
            raise InvalidTrace(f"measurements: gpu {name!r} needs exactly {_GPU_KEYS}")
        gpus[name] = {k: _number(f"gpu {name!r}", k, g[k]) for k in _GPU_KEYS}
    raw = d.get("points")
    if not isinstance(raw, list) or not raw:
        raise InvalidTrace("measurements: needs a non-empty list of points:")
    points = [_point(p, gpus, i) for i, p in enumerate(raw)]
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise InvalidTrace("measurements: point names must be unique")
    return gpus, points


def load_measurements(
    path: str | Path = MEASUREMENTS,
) -> tuple[dict[str, dict[str, float]], list[MeasuredPoint]]:
    """Read and check the data file (``InvalidTrace`` on a malformed one)."""
    try:
        d = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise InvalidTrace(f"measurements {path}: {e}") from e
    return parse_measurements(d)


def compare_measured(hw: Hardware, path: str | Path = MEASUREMENTS) -> list[dict]:
    """Every point of the data file beside the decode model's prediction there, with ``hw``'s
    efficiencies (MBU, decode MFU, step overhead, memory fractions) on the point's GPU."""
    gpus, points = load_measurements(path)
    rows = []
    for p in points:
        phw = dataclasses.replace(hw, **gpus[p.gpu])
        # only step_s is evaluated: the lengths (needed to build the model) play no part
        placeholder = LengthModel(median=1, sigma=1, max_tokens=1, prompt_tokens=p.context)
        model = DecodeModel(phw, p.shape, placeholder, p.tp)
        a, c = np.array([float(p.batch)]), np.array([p.context])
        mem, compute = (float(x[0]) for x in model.step_terms(a, c))
        step = float(model.step_s(a, c)[0])
        predicted = 1.0 / step
        measured = p.per_sequence_tok_s
        rows.append(
            {
                "name": p.name,
                "model": p.model,
                "engine": p.engine,
                "gpu": p.gpu,
                "tp": p.tp,
                "batch": p.batch,
                "context": p.context,
                "bound": "memory" if mem >= compute else "compute",
                "predicted_step_ms": step * 1e3,
                "predicted_per_sequence_tok_s": predicted,
                "predicted_tok_s_per_gpu": predicted * p.batch / p.tp,
                "measured": p.value,
                "measured_printed": p.printed,
                "measured_kind": p.kind,
                "measured_per_sequence_tok_s": measured,
                "measured_tok_s_per_gpu": measured * p.batch / p.tp,
                "ratio": predicted / measured,
                "source": p.source,
            }
        )
    return rows


def ratio_summary(rows: list[dict]) -> dict[str, float]:
    """Median, min and max of the rows' predicted ÷ measured."""
    r = np.array([row["ratio"] for row in rows])
    return {"median": float(np.median(r)), "min": float(r.min()), "max": float(r.max())}
