"""A static profile of a compiled step: its kernels, how often each launches, the bytes each moves and what XLA's
GPU cost model says it takes, read from the optimized HLO (`compiled.as_text()`), nothing run.

Model figures, not measurements. What is counted:
- a kernel is each instruction that the GPU runs as its own launch (a fusion, a custom call: cuBLAS, a Triton or
  Pallas kernel; a copy, a collective, a sort, ...) in the entry computation, a while loop's body or condition, a
  called computation, or a conditional's lightest branch (by bytes: the common path, where the other computes what
  only some requests ask for, such as prompt logprobs); bitcasts, tuples, parameters and constants launch nothing.
  A while loop with a known trip count multiplies what its body launches (its condition runs once more);
- bytes: what a launch reads and writes. A fusion parameter that the fused computation only slices (slice,
  dynamic-slice, gather) counts the slices' bytes, not the operand's; an output updated in place (the fusion's
  root a dynamic-update-slice or scatter into a parameter) counts only the update, read and written. A Pallas call
  counts its operands and outputs whole unless its kernel states what it moves (`kernels.table.pallas_hbm_bytes`:
  the grouped expert matmul reads only the experts its rows use, never the whole stack);
- time: the `reification_cost` that XLA writes into each fusion's backend config when compiled with
  `--xla_gpu_collect_cost_model_stats=true` (`targets.COST_MODEL_FLAG`): XLA's default model, except for its
  block-level Triton fusions (kind `__triton`: softmax, norms), which the default model misprices by orders of magnitude
  (hundreds of ms for a few hundred KB) and which take the indexing model's time (`COST_MODELS`). The "sol" model
  is not used: it prices a bandwidth-bound gemm (the head) at 6x its bytes / bandwidth. Custom calls carry no cost,
  and XLA's models misprice a fusion that updates a buffer in place (a KV cache write: a scatter of a few entries
  into a pool of thousands of pages: 138 us for an 8.6 MB pool, where reading and writing all of it would take
  3.6 us at 4.8 TB/s): both take their bytes over the bandwidth instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from jaxserve.kernels.table import pallas_hbm_bytes

DEFAULT_COST_MODEL = ""  # XLA's default model has no name in reification_cost
COST_MODELS = {"__triton": "indexing-cost-model"}  # fusion kind -> the model whose time it takes
PALLAS_TARGET = "__gpu$xla.gpu.triton"

_DTYPE_BYTES = {
    "pred": 1.0, "s4": 0.5, "u4": 0.5, "s8": 1.0, "u8": 1.0, "s16": 2.0, "u16": 2.0, "s32": 4.0, "u32": 4.0,
    "s64": 8.0, "u64": 8.0, "f16": 2.0, "bf16": 2.0, "f32": 4.0, "f64": 8.0, "c64": 8.0, "c128": 16.0,
    "f4e2m1fn": 0.5, "f8e8m0fnu": 1.0, "token": 0.0,
}  # fmt: skip
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
# Instructions that launch nothing: they name, reshape or group buffers.
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
    "add-dependency", "opt-barrier", "domain",
}  # fmt: skip
_SLICERS = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # a root that updates its first operand: where the update is


def array_bytes(shape: str) -> float:
    """Bytes of an HLO shape: an array `f32[4,8]{1,0}` or a tuple of them."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for d in dims.split(","):
            if d:
                count *= int(d)
        if dtype.startswith("f8"):
            total += count
        else:
            total += count * _DTYPE_BYTES.get(dtype, 4.0)
    return total


def array_dims(shape: str) -> tuple[int, ...]:
    """The dimensions of an HLO array shape (the first array of a tuple)."""
    found = _ARRAY.search(shape)
    return tuple(int(d) for d in found.group(2).split(",") if d) if found else ()


@dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attributes: str
    operand_text: str = ""  # inside the parentheses: a parameter's number, a constant's value

    def attribute(self, key: str) -> str | None:
        found = re.search(rf"\b{key}=%?([\w.\-$]+)", self.attributes)
        return found.group(1) if found else None

    @property
    def scope(self) -> str:
        """The named_scope path of its source (the metadata's op_name, without the jit wrappers)."""
        found = re.search(r'op_name="([^"]*)"', self.attributes)
        if not found:
            return ""
        parts = [p for p in found.group(1).split("/") if not p.startswith(("jit(", "vmap(", "while", "body"))]
        return "/".join(p for p in parts if p not in ("closed_call", "checkpoint", "remat"))

    def backend_config(self) -> dict:
        start = self.attributes.find("backend_config=")
        if start < 0 or self.attributes[start + 15 : start + 16] != "{":
            return {}
        text = _balanced(self.attributes, start + 15, "{", "}")
        try:
            return json.loads(text)
        except ValueError:
            return {}


def _balanced(text: str, start: int, open_: str, close: str) -> str:
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return text[start:]


def _parse_instruction(line: str) -> Instruction | None:
    body = line.strip()
    if body.startswith("ROOT "):
        body = body[5:]
    if not body.startswith("%") or " = " not in body:
        return None
    name, rest = body[1:].split(" = ", 1)
    if rest.startswith("("):
        shape = _balanced(rest, 0, "(", ")")
        rest = rest[len(shape) :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    operand_text = _balanced("(" + rest, 0, "(", ")")
    attributes = rest[len(operand_text) - 1 :]
    operands = re.findall(r"%([\w.\-]+)", operand_text)
    return Instruction(name, shape, opcode, operands, attributes, operand_text[1:-1])


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """(computations by name, the entry computation's name) of an HLO module's text."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if not line.startswith(" ") and ("{" in line) and ("(" in line):
            head = line.split(" (", 1)[0].split()
            if head and head[-1].startswith("%"):
                current = head[-1][1:]
                computations[current] = []
                if head[0] == "ENTRY":
                    entry = current
                continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            instruction = _parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    return computations, entry


@dataclass
class Kernel:
    """One kernel of a step: what runs, how often, what it moves, what the cost model says."""

    name: str
    kind: str  # the fusion's kind, the custom call's target ("pallas", "cublas", ...), or the opcode
    scope: str  # named_scope path
    launches: int
    bytes: float  # per launch: read + written
    model_us: float | None  # per launch, the cost model's time (None: a custom call, no model)

    @property
    def pallas(self) -> bool:
        return self.kind == "pallas"

    def seconds(self, bandwidth: float) -> float:
        """Per step: the cost model's time, or for a kernel without one its bytes over `bandwidth`."""
        per_launch = self.model_us * 1e-6 if self.model_us is not None else self.bytes / bandwidth
        return per_launch * self.launches


@dataclass
class StaticProfile:
    kernels: list[Kernel] = field(default_factory=list)

    @property
    def launches(self) -> int:
        return sum(k.launches for k in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(k.bytes * k.launches for k in self.kernels)

    def model_seconds(self) -> float:
        """The cost model's time of the kernels it prices (fusions, cuBLAS calls)."""
        return sum(k.model_us * 1e-6 * k.launches for k in self.kernels if k.model_us is not None)

    def pallas_bytes(self) -> float:
        return sum(k.bytes * k.launches for k in self.kernels if k.pallas)

    def estimate(self, bandwidth: float) -> float:
        """The step's static estimate: the priced kernels' model time plus every other kernel's bytes / bandwidth."""
        return sum(k.seconds(bandwidth) for k in self.kernels)

    def costliest(self, bandwidth: float, n: int = 10) -> list[Kernel]:
        return sorted(self.kernels, key=lambda k: -k.seconds(bandwidth))[:n]


def _trip_count(instruction: Instruction) -> int:
    trips = instruction.backend_config().get("known_trip_count", {}).get("n")
    if trips is None:
        raise ValueError(f"while loop {instruction.name} has no known trip count: its kernels cannot be counted")
    return int(trips)


def _in_place_update(fused: list[Instruction]) -> tuple[str, Instruction | None] | None:
    """(the parameter updated in place, the update) when a fused computation's root is a dynamic-update-slice or
    a scatter into one of its parameters (XLA aliases that operand to the output), else None."""
    root = fused[-1] if fused else None
    if root is None or root.opcode not in _IN_PLACE or not root.operands:
        return None
    by_name = {i.name: i for i in fused}
    target = by_name.get(root.operands[0])
    if target is None or target.opcode != "parameter":
        return None
    return target.name, by_name.get(root.operands[_IN_PLACE[root.opcode]])


def _fusion_bytes(instruction: Instruction, fused: list[Instruction], shapes: dict[str, str]) -> float:
    """Bytes a fusion reads and writes, its parameters that are only sliced counted by their slices."""
    users: dict[str, list[Instruction]] = {}
    for i in fused:
        for operand in i.operands:
            users.setdefault(operand, []).append(i)
    params = {int(i.operand_text): i for i in fused if i.opcode == "parameter"}
    in_place = _in_place_update(fused)
    written = array_bytes(instruction.shape)
    if in_place is not None and in_place[1] is not None:
        written = array_bytes(in_place[1].shape)
    read = 0.0
    for index, operand in enumerate(instruction.operands):
        param = params.get(index)
        whole = array_bytes(shapes.get(operand, ""))
        if param is None:
            read += whole
            continue
        if in_place is not None and param.name == in_place[0]:
            continue  # only the update is read-modified-written
        slices = _slices_of(param.name, users)
        read += whole if slices is None else min(whole, sum(array_bytes(s.shape) for s in slices))
    return read + written


def _slices_of(name: str, users: dict[str, list[Instruction]]) -> list[Instruction] | None:
    """The slicing instructions that are all a fused value's uses, through bitcasts (a reshape XLA made free: a
    stack of layers' experts viewed as one run of experts, say); None when any use reads it otherwise."""
    uses = users.get(name, [])
    if not uses:
        return None
    slices: list[Instruction] = []
    for use in uses:
        if use.opcode == "bitcast":
            through = _slices_of(use.name, users)
            if through is None:
                return None
            slices += through
        elif use.opcode in _SLICERS and use.operands and use.operands[0] == name:
            slices.append(use)
        else:
            return None
    return slices


def _kind(instruction: Instruction) -> str:
    if instruction.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
        name = target.group(1) if target else ""
        return "pallas" if name == PALLAS_TARGET else ("cublas" if "cublas" in name.lower() else name or "custom-call")
    if instruction.opcode == "fusion":
        kind = re.search(r"kind=(k\w+)", instruction.attributes)
        config = instruction.backend_config().get("fusion_backend_config", {}).get("kind", "")
        return config or (kind.group(1) if kind else "fusion")
    return instruction.opcode


def _model_us(instruction: Instruction, kind: str) -> float | None:
    model = COST_MODELS.get(kind, DEFAULT_COST_MODEL)
    for cost in instruction.backend_config().get("reification_cost", []):
        if cost.get("name", "") == model:
            return float(cost.get("exec_time_us", 0.0))
    return None


def step_profile(executables: Any) -> StaticProfile:
    """The static profile of a step that runs `executables` (compiled, for a GPU) one after the other: its forward
    and its sampler, say."""
    profile = StaticProfile()
    for compiled in executables:
        profile.kernels += static_profile(compiled.as_text()).kernels
    return profile


def _moved(kernels: dict[str, Kernel]) -> float:
    return sum(k.bytes * k.launches for k in kernels.values())


def static_profile(hlo_text: str) -> StaticProfile:
    """The kernels of an optimized HLO module (`compiled.as_text()` of a GPU compile), loops unrolled by count."""
    computations, entry = parse_hlo(hlo_text)
    statements = pallas_hbm_bytes()
    shapes = {i.name: i.shape for instructions in computations.values() for i in instructions}

    def walk(computation: str, times: int) -> dict[str, Kernel]:
        """The kernels `computation` launches, run `times` times, by computation/instruction name."""
        found: dict[str, Kernel] = {}

        def add(kernels: dict[str, Kernel]) -> None:
            for key, kernel in kernels.items():
                seen = found.get(key)
                found[key] = kernel if seen is None else replace(seen, launches=seen.launches + kernel.launches)

        for instruction in computations.get(computation, []):
            op = instruction.opcode
            if op in _FREE or op.endswith("-done") or op.endswith("-update"):
                continue
            if op == "while":
                trips = _trip_count(instruction)
                body, condition = instruction.attribute("body"), instruction.attribute("condition")
                if body:
                    add(walk(body, times * trips))
                if condition:
                    add(walk(condition, times * (trips + 1)))
                continue
            if op in ("call", "async-start") and instruction.attribute("to_apply"):
                add(walk(instruction.attribute("to_apply") or "", times))
                continue
            if op == "conditional":
                add(lightest_branch(instruction, times))
                continue
            kind = _kind(instruction)
            model_us = None if kind == "pallas" or updates_in_place(instruction) else _model_us(instruction, kind)
            kernel = Kernel(instruction.name, kind, instruction.scope, times, kernel_bytes(instruction, kind), model_us)
            add({f"{computation}/{instruction.name}": kernel})
        return found

    def lightest_branch(instruction: Instruction, times: int) -> dict[str, Kernel]:
        """A conditional runs one branch: the one that moves the fewest bytes is counted (a step's common path,
        where the other branch computes what only some requests ask for, such as prompt logprobs)."""
        branches = [
            walk(branch, times)
            for branch in re.findall(r"%([\w.\-]+)", instruction.attributes.split("branch_computations=")[-1])
        ]
        return min(branches, key=_moved) if branches else {}

    def updates_in_place(instruction: Instruction) -> bool:
        fused = computations.get(instruction.attribute("calls") or "", [])
        return instruction.opcode == "fusion" and _in_place_update(fused) is not None

    def kernel_bytes(instruction: Instruction, kind: str) -> float:
        if kind == "pallas":
            kernel = instruction.scope.split("/pallas_call")[0].rsplit("/", 1)[-1]
            if kernel in statements:
                operands = [shapes.get(o, "") for o in instruction.operands]
                return statements[kernel](
                    [array_dims(s) for s in operands],
                    [array_bytes(s) for s in operands],
                    array_bytes(instruction.shape),
                )
        if instruction.opcode == "fusion":
            return _fusion_bytes(instruction, computations.get(instruction.attribute("calls") or "", []), shapes)
        return sum(array_bytes(shapes.get(o, "")) for o in instruction.operands) + array_bytes(instruction.shape)

    return StaticProfile(list(walk(entry, 1).values()))
