"""The examples' check: train the same model on one process with plain PyTorch, on the same
micro-batches, and compare its losses with the pipelined run's (``EQUAL`` within 1e-5)."""

import torch


def check_against_single_device(twin, criterion, micro_batches, losses, config):
    """Print the verdict on rank 0 and exit non-zero when the losses differ.

    ``twin`` is the single-device ``GraphModel``; ``micro_batches(step)`` returns the step's
    ``[(inputs, labels)]``; ``config`` is the DeepSpeed config dict (its Adam learning rate,
    weight decay and gradient clipping are applied the same way).
    """
    params = config["optimizer"]["params"]
    opt = torch.optim.Adam(twin.parameters(), lr=params["lr"], weight_decay=params.get("weight_decay", 0.0))
    reference = []
    for step in range(len(losses)):
        opt.zero_grad()
        batches = micro_batches(step)
        total = 0.0
        for inputs, labels in batches:
            # a batch's inputs are a tuple, one per graph input, or one tensor
            loss = criterion(twin(*inputs) if isinstance(inputs, tuple) else twin(inputs), labels)
            (loss / len(batches)).backward()   # DeepSpeed averages over gradient accumulation
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), config["gradient_clipping"])
        opt.step()
        reference.append(total / len(batches))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    same = worst <= 1e-5
    print(f"single-device GraphModel losses: {[round(x, 5) for x in reference]}")
    print(f"pipelined losses {'EQUAL' if same else 'DIFFER FROM'} the single-device run "
          f"(max relative difference {worst:.2e})", flush=True)
    if not same:
        raise SystemExit(1)
