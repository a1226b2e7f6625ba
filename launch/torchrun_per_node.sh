#!/usr/bin/env bash
# Start this node's part of a multi-node zerorun job: one zerorun, which runs one torchrun, which
# starts one rank per local GPU. Run it on every node, at about the same time, with the same
# NNODES, MASTER_ADDR, MASTER_PORT, RUN_DIR and overrides, and a different NODE_RANK.
#
#   # on gpu-node-01 (node 0: it hosts the rendezvous at MASTER_ADDR:MASTER_PORT)
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=gpu-node-01 RUN_DIR=/shared/runs/gpt2-2n \
#     launch/torchrun_per_node.sh +model=gpt2 zero=stage2
#   # on gpu-node-02
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=gpu-node-01 RUN_DIR=/shared/runs/gpt2-2n \
#     launch/torchrun_per_node.sh +model=gpt2 zero=stage2
#
# Environment:
#   NNODES       number of nodes (required)
#   NODE_RANK    this node's rank, 0 .. NNODES-1 (required)
#   MASTER_ADDR  address of node 0, reachable from every node (required)
#   MASTER_PORT  a free TCP port on node 0 (default 29500; the same on every node)
#   RUN_DIR      absolute path of the run dir on a filesystem every node sees (required): every
#                node writes the same config there and ranks checkpoint into it. Hydra's default
#                (outputs/<name>/<time>) would differ from node to node.
#   ZERORUN      the zerorun executable (default: zerorun on PATH)
# NCCL settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG, ...) are inherited from the environment.
set -euo pipefail

die() {
    echo "torchrun_per_node.sh: $*" >&2
    exit 2
}

[[ -n ${NNODES:-} ]] || die "set NNODES, the number of nodes."
[[ -n ${NODE_RANK:-} ]] || die "set NODE_RANK, the rank of this node (0 .. NNODES-1)."
[[ -n ${MASTER_ADDR:-} ]] || die "set MASTER_ADDR, the address of node 0."
[[ -n ${RUN_DIR:-} ]] || die "set RUN_DIR, an absolute path on a filesystem shared by all nodes."
MASTER_PORT=${MASTER_PORT:-29500}
ZERORUN=${ZERORUN:-zerorun}

[[ $NNODES =~ ^[1-9][0-9]*$ ]] || die "NNODES=$NNODES: must be a positive integer."
[[ $NODE_RANK =~ ^[0-9]+$ ]] || die "NODE_RANK=$NODE_RANK: must be an integer."
((NODE_RANK < NNODES)) || die "NODE_RANK=$NODE_RANK: must be below NNODES=$NNODES."
[[ $MASTER_PORT =~ ^[0-9]+$ ]] || die "MASTER_PORT=$MASTER_PORT: must be a port number."
[[ $RUN_DIR == /* ]] || die "RUN_DIR=$RUN_DIR: must be an absolute path (the same on every node)."
command -v "$ZERORUN" > /dev/null || die "$ZERORUN not found: activate the venv or set ZERORUN."

echo "torchrun_per_node.sh: node $NODE_RANK of $NNODES, rendezvous $MASTER_ADDR:$MASTER_PORT, run dir $RUN_DIR" >&2
exec "$ZERORUN" "$@" \
    launcher=torchrun \
    "launcher.nnodes=$NNODES" \
    "launcher.node_rank=$NODE_RANK" \
    "launcher.master_addr=$MASTER_ADDR" \
    "launcher.master_port=$MASTER_PORT" \
    "hydra.run.dir=$RUN_DIR"
