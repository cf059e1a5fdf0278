"""The autograd function that the sleeping-layer benchmarks (schedules.py, peers.py) build their
layers from: sleeps stand in for device compute, occupying a rank without using a core."""

import time


def sleep_grad():
    """``SleepGrad.apply(x, seconds)``: identity whose backward sleeps ``seconds`` (made on first
    use, so importing this module needs no torch)."""
    import torch

    class SleepGrad(torch.autograd.Function):
        """Identity; the backward sleeps ``seconds`` before passing the gradient on."""

        @staticmethod
        def forward(ctx, x, seconds):
            ctx.seconds = seconds
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            if ctx.seconds:
                time.sleep(ctx.seconds)
            return grad, None

    return SleepGrad
