"""How fast a model runs on a GPU, and how much KV cache it has: the simulator's ``Profile``.

A step of the engine takes ``b0 + b1·prefill_tokens + b2·decode_tokens + b3·context_tokens``
seconds, where ``context_tokens`` is the number of tokens every scheduled request attends to (its
KV read), optionally multiplied by ``1 + N(0, jitter)`` drawn from the engine's seeded RNG, plus
the time to load LoRA adapters that are not resident. The default profile is an 8B model
(Llama 3.1 8B, bf16) on one H100 80GB: about 5.75 ms per step, 17.3 µs per prefill token,
6.0 µs per decode token, 20 ns per context token, and 28,000 KV blocks of 16 tokens
(about 0.9 x 80 GB, less 16 GB of weights, at 128 KiB of KV per token).

Profiles are built in (``PROFILES``) or read from a YAML/JSON file whose keys are ``Profile``
fields, optionally starting from ``base: <built-in name>``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import yaml


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Step-time coefficients and cache sizing of one model on one GPU."""

    name: str
    b0: float = 5.75e-3
    """Fixed cost of a step, seconds."""
    b1: float = 17.3e-6
    """Seconds per prefill token (prompt tokens, and tokens recomputed after a preemption)."""
    b2: float = 6.0e-6
    """Seconds per decode token."""
    b3: float = 2.0e-8
    """Seconds per context token attended to by the scheduled requests (KV reads)."""
    jitter: float = 0.0
    """Relative standard deviation of step time (0 = deterministic)."""
    num_gpu_blocks: int = 28_000
    block_size: int = 16
    max_model_len: int = 131_072
    lora_load_cpu_s: float = 0.1
    """Seconds to move an adapter from the CPU cache into a GPU slot."""
    lora_load_disk_s: float = 0.5
    """Seconds to load an adapter that is not in the CPU cache (from disk)."""

    def step_time(self, prefill_tokens: int, decode_tokens: int, context_tokens: int) -> float:
        """Duration of one step without jitter or adapter loads, in seconds."""
        return (
            self.b0
            + self.b1 * prefill_tokens
            + self.b2 * decode_tokens
            + self.b3 * context_tokens
        )

    def validate(self) -> Profile:
        """Return self, or raise ValueError naming the first field that cannot work."""
        for field in ("b0", "b1", "b2", "b3", "jitter", "lora_load_cpu_s", "lora_load_disk_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"profile {self.name}: {field} must be >= 0")
        if self.b0 <= 0:
            raise ValueError(f"profile {self.name}: b0 must be > 0 (a step always takes time)")
        for field in ("num_gpu_blocks", "block_size", "max_model_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"profile {self.name}: {field} must be >= 1")
        return self


DEFAULT_PROFILE = "llama-3.1-8b-h100"

PROFILES: dict[str, Profile] = {
    DEFAULT_PROFILE: Profile(name=DEFAULT_PROFILE),
    # A 70B model on 4 x H100 (tensor parallel): slower steps, roughly the same KV room per GPU.
    "llama-3.1-70b-4xh100": Profile(
        name="llama-3.1-70b-4xh100",
        b0=14.0e-3,
        b1=38.0e-6,
        b2=15.0e-6,
        b3=1.0e-8,
        num_gpu_blocks=31_000,
    ),
}


def load_profile(spec: str) -> Profile:
    """A built-in profile by name, or one read from a YAML/JSON file (``base:`` picks defaults)."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"unknown profile {spec!r}: not a built-in ({', '.join(PROFILES)}) nor a file"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"profile file {path}: not YAML/JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile file {path}: expected a mapping of Profile fields")
    base_name = data.pop("base", DEFAULT_PROFILE)
    if base_name not in PROFILES:
        raise ValueError(f"profile file {path}: unknown base {base_name!r}")
    merged = msgspec.structs.asdict(PROFILES[base_name]) | {"name": path.stem} | data
    try:
        return msgspec.convert(merged, Profile).validate()
    except msgspec.ValidationError as error:
        raise ValueError(f"profile file {path}: {error}") from None
