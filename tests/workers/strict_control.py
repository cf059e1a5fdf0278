"""Worker: the controls of the strict transport (``tests/strict_p2p.py``), on two ranks.

``python strict_control.py SCENARIO``; with ``GPP_STRICT_P2P=1`` the strict transport is installed.
Each rank sends a tensor of its rank to the other and prints what it received:

``cross_send``
    each rank posts its send in a batch of its own, then its receive in another: NCCL deadlocks
    (each send waits for a receive its peer launches only after its own send completed);
``mixed``
    rank 0 sends in a batch, rank 1 receives with a single ``irecv`` (different NCCL communicators);
``grouped``
    each rank posts its send and its receive in one batch: safe everywhere;
``transport``
    the same batch through the engine's transport (``EdgeTransport.start`` / ``finish``), which
    also prints whether it posts one by one (torch's own ``batch_isend_irecv`` on gloo) or through
    ``batch_isend_irecv`` (a replacement installed).
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
    elif scenario == "transport":
        from gpp_deepspeed.engine import p2p

        transport = p2p.EdgeTransport(None, torch.device("cpu"), stage=rank, timeout_s=30)
        recv = p2p.Incoming(peer, peer, [got])
        works = [w for ws in transport.start([p2p.Outgoing(peer, peer, [out])], [recv]) for w in ws]
        print(f"one by one={not transport._coalesces and dist.batch_isend_irecv is p2p._TORCH_BATCH_ISEND_IRECV}")
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
