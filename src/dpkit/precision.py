"""Mixed precision: "32", "bf16-mixed" (CPU and CUDA autocast) and "16-mixed" (CUDA autocast + GradScaler).

Autocast runs the forward in the low-precision dtype where it is safe and keeps the parameters and their
gradients in float32, so the optimizer and every strategy's gradient reduction see float32 as usual.
float16 has a narrow exponent range: small gradients underflow unless the loss is scaled up first and
the gradients scaled back down before the step, which is what the GradScaler does (and skips steps
whose gradients overflowed).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

PRECISIONS = ("32", "bf16-mixed", "16-mixed")


class Precision:
    """The autocast context and, for "16-mixed", the loss scaler, for one device type."""

    def __init__(self, precision: str = "32", device_type: str = "cpu"):
        precision = str(precision)
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
        if precision == "16-mixed" and device_type != "cuda":
            raise ValueError(
                "precision='16-mixed' needs CUDA (float16 autocast with a GradScaler); "
                "on CPU use precision='bf16-mixed', or '32'"
            )
        self.precision = precision
        self.device_type = device_type
        self.dtype = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler("cuda") if precision == "16-mixed" else None

    def autocast(self) -> AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> float:
        """Before clipping: divide the gradients `optimizer` steps by the loss scale (16-mixed; a no-op otherwise).
        Returns the factor applied, for gradients the scaler does not see (other replicas' copies)."""
        if self.scaler is None:
            return 1.0
        scale = float(self.scaler.get_scale())
        self.scaler.unscale_(optimizer)
        return 1.0 / scale

    def step(self, optimizer: torch.optim.Optimizer) -> float | None:
        """optimizer.step(), through the scaler when there is one (it unscales, and skips on inf/nan)."""
        if self.scaler is None:
            return optimizer.step()
        result = self.scaler.step(optimizer)
        self.scaler.update()
        return result

    def __repr__(self) -> str:
        return f"Precision({self.precision!r}, device_type={self.device_type!r})"
