"""Worker: the controls of the strict transport (``tests/strict_p2p.py``), on two ranks.

``python strict_control.py SCENARIO``; with ``GPP_STRICT_P2P=1`` the strict transport is installed.
Each rank sends a tensor of its rank to the other and prints what it received:

``cross_send``
    each rank posts its send in a batch of its own, then its receive in another: NCCL deadlocks
    (each send waits for a receive its peer launches only after its own send completed);
``mixed``
    rank 0 sends in a batch, rank 1 receives with a single ``irecv`` (different NCCL communicators);
``grouped``
    each rank posts its send and its receive in one batch: safe everywhere.
"""

import os
import sys

import torch
import torch.distributed as dist

import strict_p2p


def main():
    scenario = sys.argv[1]
    dist.init_process_group("gloo")
    if os.environ.get("GPP_STRICT_P2P") == "1":
        strict_p2p.install()
    rank = dist.get_rank()
    peer = 1 - rank
    out, got = torch.full((4, ), float(rank)), torch.empty(4)
    if scenario == "cross_send":
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer)])
        works += dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer)])
    elif scenario == "mixed":
        if rank == 0:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer)])
            works += [dist.irecv(got, peer)]
        else:
            works = [dist.irecv(got, peer)]
            works += dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer)])
    elif scenario == "grouped":
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, got, peer)])
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    for w in works:
        w.wait()
    print(f"received {got.tolist()} strict={strict_p2p.stats()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
