"""What every key of every command's JSON output means: the one registry of them.

docs/reference/json.md is generated from it (`python -m ringtree.json_keys`), and the tests hold
each command's output to its entry, so a key added without its description fails a test. A list's
items are `list[].key`, a nested object's keys `object.key`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Output:
    """One command's JSON: how to get it, what it is, and its keys with their meanings."""

    command: str
    shape: str
    keys: dict[str, str]


OUTPUTS: dict[str, Output] = {
    "bench": Output(
        "ringtree bench --json FILE",
        "a list of rows, one per algorithm and size",
        {
            "collective": "all_reduce, reduce_scatter, all_gather, broadcast, reduce or all_to_all",
            "algorithm": "the schedule (or `native`: torch.distributed's own)",
            "bytes": "the message size in bytes",
            "count": "the message size in elements of `dtype`",
            "dtype": "element type, e.g. float32",
            "op": "reduction: sum, avg, product, max or min",
            "world_size": "ranks",
            "nodes": "nodes (torchrun's `LOCAL_WORLD_SIZE`, or `--local-size` with `--nproc`)",
            "ranks_per_node": "ranks on each node",
            "transport": "shm (ringtree's shared memory within a host) or gloo/nccl",
            "time_us": "the slowest rank's mean time per call, microseconds",
            "time_s": (
                "the same time in seconds (the key `sim` rows use, so bench and sim rows compare directly)"
            ),
            "algbw_gbps": "bytes / time, GB/s",
            "busbw_gbps": "algbw x the nccl-tests factor, GB/s",
            "wrong": "wrong elements in the checked call, summed over ranks",
        },
    ),
    "show": Output(
        "ringtree show ALGORITHM --json FILE",
        "one object: the schedule and what each rank holds",
        {
            "collective": "all_reduce, reduce_scatter, all_gather, broadcast or reduce",
            "algorithm": "the schedule shown",
            "ranks": "ranks",
            "nodes": "nodes",
            "bytes": "the buffer's size",
            "itemsize": "bytes per element",
            "chunks": "the chunks' byte ranges, [start, end)",
            "holds_tracked_for": "the ranks whose holdings are followed (`holds` below)",
            "bytes_sent_per_rank": "bytes each rank sends over the whole schedule",
            "alpha_beta_s": "the closed form's time on `--link`",
            "simulated_s": "the replay's time on `--link`",
            "steps": "one entry per step",
            "steps[].step": "its index",
            "steps[].kind": "reduce, copy or reduce+copy",
            "steps[].ranks": "per rank, what it does in the step",
            "steps[].ranks[].rank": "the rank",
            "steps[].ranks[].sends": "its sends",
            "steps[].ranks[].sends[].to": "to which rank",
            "steps[].ranks[].sends[].chunks": "which chunks",
            "steps[].ranks[].sends[].bytes": "how many bytes",
            "steps[].ranks[].recvs": "its receives",
            "steps[].ranks[].recvs[].from": "from which rank",
            "steps[].ranks[].recvs[].chunks": "which chunks",
            "steps[].ranks[].recvs[].bytes": "how many bytes",
            "steps[].ranks[].recvs[].reduce": "reduced into its own (true) or copied (false)",
            "steps[].ranks[].holds": (
                "for tracked ranks: chunk -> the ranks whose inputs it sums after the step"
            ),
        },
    ),
    "show-pipeline": Output(
        "ringtree show gpipe|1f1b|interleaved|pipedream|zb-h1|zb-h2|zb-v|dualpipev --json FILE",
        "one object: the pipeline schedule's timeline",
        {
            "schedule": "gpipe, 1f1b, interleaved, pipedream, pipedream-vs, zb-h1, zb-h2, zb-v or dualpipev",
            "stages": "pipeline stages (p)",
            "micro_batches": "micro-batches (m)",
            "virtual_stages": "chunks per stage (V; 1 but for interleaved, 2 for zb-v and dualpipev)",
            "placement": "loop (chunk c of stage j is c p + j) or v (stage j holds chunks j and 2p-1-j)",
            "splits_backward": "whether the backward is B (input gradient) then W (weight gradient)",
            "bubble_fraction": "idle share of the stages' slots",
            "theoretical_bubble_fraction": "(p-1)/(m+p-1), or the schedule's own",
            "activations_in_flight": "per stage, the most micro-batches whose activations it keeps",
            "weight_versions": "per stage, the most weight versions it keeps",
            "forward_versions": "per stage and micro-batch, the weight version its forward used",
            "steps": "one entry per slot",
            "steps[].step": "the slot",
            "steps[].stages": "every stage's work in it",
            "steps[].stages[].stage": "the stage",
            "steps[].stages[].op": "forward, backward (B alone when split), weight (W) or idle",
            "steps[].stages[].micro_batch": "the micro-batch (null when idle)",
            "steps[].stages[].version": "the weight version used (null when idle)",
        },
    ),
    "show-diloco": Output(
        "ringtree show diloco --json FILE",
        "one object: the replicas' inner steps and the fragments' outer synchronisations",
        {
            "replicas": "replica groups (R)",
            "inner_steps": "inner steps between two synchronisations of a fragment (H)",
            "fragments": "fragments synchronised in turn (F)",
            "overlap_steps": "inner steps a fragment's all-reduce runs behind (T)",
            "steps_between_syncs": "H/F: inner steps between two fragment synchronisations",
            "bytes_per_sync": "the share of the model's pseudo-gradients one synchronisation moves (1/F)",
            "syncs": "one entry per synchronisation, in order",
            "syncs[].fragment": "the fragment",
            "syncs[].sent_after": "the inner step after which its pseudo-gradient is sent",
            "syncs[].applied_after": "the inner step after which its outer step is applied",
            "steps": "one entry per inner step",
            "steps[].step": "the inner step (from 1)",
            "steps[].sends": "fragments whose all-reduce starts after it",
            "steps[].in_flight": "fragments whose all-reduce runs during it",
            "steps[].applies": "fragments whose outer step is applied after it",
        },
    ),
    "show-a2a": Output(
        "ringtree show pairwise|bruck|linear|hierarchical-a2a --json FILE",
        "one object: the all-to-all schedule and what each rank sends, receives and holds",
        {
            "collective": "all_to_all",
            "algorithm": "the schedule shown: pairwise, bruck, linear or hierarchical",
            "ranks": "ranks",
            "nodes": "nodes",
            "bytes": "each rank's buffer (what it sends to all ranks together, its own block included)",
            "itemsize": "bytes per element",
            "alpha_beta_s": "the closed form's time on `--link` (and `--intra`)",
            "textbook": "the algorithm's textbook cost, as a formula",
            "steps": "one entry per step",
            "steps[].step": "its index",
            "steps[].ranks": "one entry per rank",
            "steps[].ranks[].rank": "the rank",
            "steps[].ranks[].sends": "its messages in this step",
            "steps[].ranks[].sends[].to": "the peer",
            "steps[].ranks[].sends[].blocks": "the blocks it carries, each [source rank, destination rank]",
            "steps[].ranks[].sends[].bytes": "the message's bytes",
            "steps[].ranks[].receives": "the messages it receives in this step",
            "steps[].ranks[].receives[].from": "the peer",
            "steps[].ranks[].receives[].blocks": "the blocks, each [source rank, destination rank]",
            "steps[].ranks[].receives[].bytes": "the message's bytes",
            "steps[].ranks[].output_from": (
                "the ranks whose block for this rank has arrived by the step's end"
            ),
            "steps[].ranks[].forwarding": "blocks it holds for other ranks, to forward in a later step",
        },
    ),
    "show-moe": Output(
        "ringtree show moe-dispatch --json FILE",
        "one object: a small example of the token dispatch, step by step",
        {
            "ranks": "expert-parallel ranks",
            "experts": "experts of the layer (rank r holds E/P from r E/P)",
            "tokens": "tokens per rank in the example",
            "top_k": "experts per token",
            "steps": "the steps in order",
            "steps[].action": "what the step does",
            "steps[].communication": "its collective, or empty when local",
            "steps[].ranks": "per rank, what it holds or sends",
            "steps[].sends": "for an all-to-all: rows (integers for the counts) from rank i to rank j",
        },
    ),
    "sim": Output(
        "ringtree sim --json FILE",
        "a list of rows, one per algorithm and size (or node count)",
        {
            "collective": "`all-reduce` or `all-to-all` (`--collective`)",
            "algorithm": "the algorithm the row prices",
            "ranks": "GPUs in the collective",
            "nodes": "nodes",
            "gpus_per_node": "GPUs per node",
            "nics_per_node": "NICs per node the inter-node traffic shares (`--nics-per-node`)",
            "nic_GBps": "each NIC's bandwidth (the `--inter` link), GB/s",
            "bytes": "the all-reduced buffer; of an all-to-all, the per-rank buffer (nccl-tests' size)",
            "time_s": "the predicted time",
            "method": "how: `replay`, `closed-form`, `nccl-model` or `measured` (a calibration's rows)",
            "algbw_gbps": "bytes / time, GB/s",
            "busbw_gbps": (
                "algbw x 2(p-1)/p for an all-reduce, x (p-1)/p for an all-to-all (nccl-tests' bus "
                "bandwidth), GB/s"
            ),
            "nccl_choice": (
                "for `native` on a GPU cluster: NCCL's algorithm/protocol pick, `p2p/LL` or `p2p/Simple` "
                "for an all-to-all (absent otherwise)"
            ),
        },
    ),
    "plan": Output(
        "ringtree plan --model TRANSFORMER --json FILE",
        "one object: the predicted step, its parts and memory",
        {
            "algorithm": "the all-reduce algorithm the plan prices",
            "ranks": "GPUs",
            "nodes": "nodes",
            "step_s": "seconds per optimizer step (iteration)",
            "samples_per_s": "sequences per second, all GPUs",
            "mfu": (
                "model FLOPs per step (no recompute) / (step_s x GPUs x dense peak); the BF16 peak for FP8 "
                "runs too"
            ),
            "tokens_per_s_per_gpu": "global batch x sequence / step_s / GPUs",
            "tflops_per_gpu": "the same model FLOPs per GPU per second, in TFLOP/s",
            "hardware_tflops_per_gpu": (
                "FLOPs per GPU per second counting the recompute (Megatron-LM 2021's figure)"
            ),
            "dp_allreduce_s": (
                "the whole gradient reduction (all-reduce, or reduce-scatter under ZeRO), hidden or not"
            ),
            "dp": "data-parallel degree",
            "tp": "tensor-parallel degree",
            "cp": "context-parallel degree",
            "pp": "pipeline stages",
            "virtual_stages": "model chunks per pipeline rank",
            "sequence_parallel": "Megatron's sequence parallelism on",
            "zero": "ZeRO stage",
            "micro_batches": "micro-batches per step per pipeline (m)",
            "tp_link": "intra or inter: where the TP group runs",
            "ep": "expert-parallel degree (1 for a dense model)",
            "etp": "expert tensor-parallel degree",
            "breakdown": "seconds per part of the step; they add up to `step_s`",
            "breakdown.compute_s": "forward and backward compute (recompute included)",
            "breakdown.optimizer_s": "the optimizer's pass over its states",
            "breakdown.tp_comm_s": "TP (and SP) collectives on the critical path",
            "breakdown.cp_comm_s": "the CP K/V exchange attention did not hide",
            "breakdown.ep_comm_s": "the expert-parallel dispatch and combine exchanges left exposed",
            "breakdown.pp_bubble_s": "pipeline bubble, with the stage messages on the critical path",
            "breakdown.sync_wait_s": "a finished run's wait (`--from-run`)",
            "breakdown.exposed_dp_s": "gradient reduction left exposed",
            "breakdown.exposed_zero_gather_s": "ZeRO parameter all-gathers left exposed",
            "memory": "bytes per GPU (null for the data-parallel planner)",
            "memory.total_GiB": "the fullest stage's bytes per GPU",
            "memory.fits": "whether every stage fits the GPU's memory",
            "memory.capacity_GiB": "the GPU's memory",
            "memory.fullest_stage": "which pipeline stage is fullest",
            "memory.overflow_GiB": "how much the fullest stage exceeds the memory (0 when it fits)",
            "memory.weights_grads_optimizer_GiB": "the fullest stage's states",
            "memory.activations_GiB": "the fullest stage's activations",
            "memory.stages": "every stage's states, activations and total",
            "details": (
                "the model spec, the layout (`training`), the GPU, parameters and model FLOPs per step"
            ),
            "planner": (
                "which model ran: `transformer` (compute from the model's FLOPs, the layout, ZeRO, the "
                "pipeline) or `data-parallel` (the typed compute time, the whole model on every GPU)"
            ),
            "network": "what the plan assumed each node has",
            "network.gpus_per_node": "GPUs per node",
            "network.intra": "the link between a node's GPUs",
            "network.nics_per_node": "NICs per node, shared by the groups crossing nodes (`--nics-per-node`)",
            "network.nic": "each NIC's link (`--inter`)",
            "network.nic_GBps": "each NIC's bandwidth, GB/s",
        },
    ),
    "plan-dp": Output(
        "ringtree plan --compute-time S --json FILE",
        "the step keys of `plan` (`memory`, `mfu` and the FLOP rates null, `details` empty), and",
        {
            "algorithms": (
                "every algorithm's row (the step keys, `speedup_vs_one_node`, `scaling_efficiency`)"
            ),
            "recommended_algorithm": "the algorithm with the shortest step",
            "reason": "why, and what else would help",
            "speedup_vs_one_node": "throughput on the cluster over one of its nodes",
            "scaling_efficiency": "that speedup over the node count",
            "grad_bytes": "bytes of gradients all-reduced per step",
            "config": (
                "the step's inputs (`params`, `compute_time_s` per micro-step, dtypes, buckets, overlap, ...)"
            ),
            "cluster": "the modelled cluster",
            "cluster_title": "the cluster in one line",
            "explain": (
                "the bound per link level, the `bottleneck` and its share, the network for 90% "
                "efficiency, the error bar, the printed lines"
            ),
            "pipeline": "with `--pp`: the pipeline's schedule, bubble and stage times",
            "tensor_parallel": "with `--tp`: the TP group's link and per-step collective time",
        },
    ),
    "calibrate": Output(
        "ringtree calibrate FILES --out FILE",
        "one object: the fitted links and their residuals (keys marked two-level appear only then)",
        {
            "alpha_s": "the intra-node (or only) link's latency per message",
            "beta_s_per_byte": "its seconds per byte",
            "bandwidth_Bps": (
                "1 / `beta_s_per_byte`, under the name a link file uses, so the file also serves `--intra "
                "FILE`"
            ),
            "gamma_s_per_byte": "reduction seconds per byte (0 for an nccl-tests fit: in NCCL's bandwidth)",
            "inter_alpha_s": "two-level: the inter-node link's latency (null otherwise)",
            "inter_beta_s_per_byte": "two-level: its seconds per byte (null otherwise)",
            "inter_bandwidth_Bps": "two-level: 1 / `inter_beta_s_per_byte`",
            "world_size": "the largest world the rows came from",
            "rows": "rows fitted",
            "rms_rel_error": "the fit's root-mean-square relative residual over them",
            "max_rel_error": "its largest relative residual",
            "levels": "the same two figures and the row count per level (`intra`, `inter`)",
            "nccl": (
                "an nccl-tests fit: NCCL's system, the fitted corrections, links, NICs, the fitted names "
                "and the measured `table`; with bench rows too, also that fit's own `rows`, "
                "`rms_rel_error`, `max_rel_error`, `levels`"
            ),
            "algorithms": "each algorithm's own bench fit (its alpha, beta, gamma and residuals)",
            "measured": "the bench rows kept for interpolation at their sizes and counts",
            "source": "the input files",
        },
    ),
    "train": Output(
        "ringtree train --json FILE",
        "one object: the run's summary (`null`: not used in this run)",
        {
            "accuracy": "test accuracy, a fraction of 1; null without class targets",
            "test_loss": "mean loss on the test split",
            "train_loss": "mean training loss over the last epoch, all replicas",
            "final_loss": "the last optimizer step's training loss, averaged over the replicas",
            "samples_per_s": "training samples per second, all replicas",
            "step_time_s": "mean optimizer step time after the first, the slowest rank's",
            "comm_time_s": "mean gradient communication per step (overlapped or not)",
            "exposed_comm_time_s": "the part of it the step waited for",
            "powersgd_compute_s": (
                "with `--compression powersgd`: seconds per compressed step of PowerSGD's own work on the "
                "slowest rank (error feedback, the low-rank products, orthogonalisation; its all-reduces "
                "excluded), host wall time; null without it, before `--powersgd-start-iter` or on GPU"
            ),
            "predicted_step_time_s": "the planner's step time with `--calibration`; else null",
            "world_size": "ranks",
            "nodes": "nodes",
            "dp": "data-parallel replicas",
            "tp": "tensor-parallel ranks per replica (the option's key too)",
            "pp": "pipeline stages per replica (the option's key too)",
            "cp": (
                "context-parallel ranks each sequence is split over (the option's key too; see "
                "[context parallelism](../context-parallel.md))"
            ),
            "ep": "expert-parallel ranks the experts are split over (the option's key too)",
            "backend": "gloo or nccl",
            "parameters": "the whole model's, whatever its shards",
            "model_state_mb": (
                "parameters + gradients + optimizer states held by the fullest rank, counted from the "
                "tensors (see ZeRO above)"
            ),
            "peak_memory_mb": (
                "the fullest rank's peak: CUDA's allocator peak on GPU, the process's peak RSS on CPU"
            ),
            "activation_memory_mb": (
                "the most activation bytes a rank saved for backward at once (autograd's saved tensors, "
                "weights excluded; a stage's under `--pp`): what `--sequence-parallel` and activation "
                "checkpointing shrink"
            ),
            "steps": "optimizer steps taken (from step 0, resumed ones included)",
            "resumed_from_step": "the checkpoint's step a resumed run started from; else null",
            "restarts": "times torch's elastic agent restarted the workers",
            "stragglers": "ranks whose own work was persistently slower than the median rank's",
            "skipped_steps": "steps skipped for non-finite gradients (fp16)",
            "checkpoint_segments": (
                "activation-checkpointed segments (0: none), as the stages made them; stands for the option"
            ),
            "checkpoint_s": (
                "the median seconds the training loop waited per checkpoint save, on the slowest rank "
                "(with `--checkpoint-async`: the copy to host memory, not the write; see "
                "[checkpoints](../checkpoints.md)); null without `--checkpoint-dir`"
            ),
            "distilled_from": "the teacher's checkpoint; else null",
            "sync": "how the replicas synchronised: ddp, local-sgd, diloco or streaming-diloco",
            "replicas": "replica groups (DDP inside each; 1 under `--sync ddp`: the whole world)",
            "inner_steps": "optimizer steps between two synchronisations of a fragment (1 under ddp)",
            "outer_syncs": "outer synchronisations applied (fragments, under streaming-diloco); else null",
            "inter_node_bytes_per_step": (
                "bytes one rank sent to ranks on other nodes, averaged per step, the largest rank's: DDP's "
                "bucket schedules (`native` counted as the ring) plus the outer averages; null with `--zero` "
                "or a low-rank `--compression`"
            ),
            "outer_comm_exposed_s": "seconds per step the training waited for the outer averages; else null",
            "outer_sync_wait_s": (
                "seconds per outer synchronisation a rank waited for the last replica to arrive (its "
                "all-reduce's time less the quickest rank's, averaged over ranks and syncs); else null"
            ),
            "bubble_fraction": "under `--pp`: measured idle fraction of the pipeline",
            "theoretical_bubble_fraction": "under `--pp`: the schedule's (p-1)/(m+p-1) or its own",
            "peak_activation_bytes_per_stage": "under `--pp`: activations held at the peak, per stage",
            "weight_versions_per_stage": "under `--pp`: weight copies kept (pipedream's stash)",
            "experts": "with MoE layers: routed experts per layer (the option's key too)",
            "top_k": "with MoE layers: experts per token (the option's key too)",
            "expert_load": (
                "with MoE layers: max / mean tokens per expert in the last step's worst layer, over every "
                "data-parallel rank (1: balanced)"
            ),
            "tokens_dropped": (
                "with MoE layers: fraction of token copies `--capacity-factor` dropped over the run "
                "(0: dropless)"
            ),
            "a2a_time_s": (
                "with MoE layers: mean seconds per step in the token dispatch's all-to-alls (counts, "
                "dispatch, combine and their backwards), each from its start to its end, whether the "
                "training thread waited or computed meanwhile; the slowest rank's"
            ),
            "a2a_exposed_s": (
                "with MoE layers: mean seconds per step the training thread waited for those "
                "all-to-alls, the slowest rank's: all of a blocking one; of a dispatch or combine "
                "overlapped with the shared experts (`--moe-shared-expert-overlap`, with `--ep` and "
                "`--shared-experts`), only the part that outlasted them. At most `a2a_time_s` "
                "on each rank"
            ),
            "devices": "under `--mode dp-threads`: the devices",
            "device_held_bytes": "under `--mode dp-threads`: what each device held in the last step",
            "device_imbalance": "under `--mode dp-threads`: max / mean of it",
            "recipe": (
                "the model's recipe the unset `--lr`, `--epochs`, `--batch-size` came from (`default` for"
                " a factory)"
            ),
        },
    ),
    "checkpoint-inspect": Output(
        "ringtree checkpoint inspect DIR --json FILE",
        "one object: what the checkpoint holds and whether it verifies",
        {
            "path": "the checkpoint read: a `step-<N>.pt` file or a `step-<N>.dcp` folder",
            "kind": "dense or sharded",
            "step": "the optimizer step it was saved at",
            "model_name": "the model's class name",
            "layout": (
                "the layout it was saved at (world size, dp, tp, pp, cp, zero, and ep for an expert-parallel "
                "run); null when unrecorded"
            ),
            "files": "every file of it",
            "files[].name": "the file's name",
            "files[].bytes": "its size",
            "files[].sha256": "its SHA-256",
            "bytes": "the files' total size",
            "verifies": "whether every file matches its record",
            "problem": "why it does not verify; else null",
        },
    ),
    "emulate": Output(
        "ringtree emulate --json FILE -- COMMAND",
        "one object: the emulated cluster's record",
        {
            "nodes": "emulated nodes",
            "ranks_per_node": "ranks on each node",
            "inter_bw": "every node's configured link rate, as given (e.g. 1gbit)",
            "slow": "node -> its slower configured rate (`--slow`)",
            "burst_bytes": "node -> its token bucket's depth in bytes",
            "cpu_policy": "how the ranks share the host's cores",
            "cpus_per_node": "each node's cap in cores, a cgroup quota (`--cpus-per-node`; null: shared)",
            "links": "node 0 to every other node, measured before the job (empty with `--no-measure`)",
            "links[].node": "the far node",
            "links[].configured_gbps": "the pair's configured rate (the slower end's), Gbit/s",
            "links[].bytes": "the probe's message size",
            "links[].measured_gbps": "measured rate, back to back, Gbit/s",
            "links[].after_idle_gbps": "measured rate after an idle pause (a full token bucket), Gbit/s",
            "links[].latency_us": "one small message's round trip / 2, microseconds",
            "command": "the command the nodes ran",
            "link_bytes": (
                "every node's interface during the job (the link probe excluded), from the kernel's counters"
            ),
            "link_bytes[].node": "the node",
            "link_bytes[].sent": (
                "bytes its interface sent to other nodes: frames with headers, retransmissions included"
            ),
            "link_bytes[].received": "bytes its interface received from other nodes",
            "exit_code": "the job's exit code (the command's own, e.g. doctor's 1)",
        },
    ),
    "doctor": Output(
        "ringtree doctor --json FILE",
        "one object: the report",
        {
            "world_size": "ranks measured",
            "nodes": "nodes",
            "ranks_per_node": "ranks on each node",
            "versions": "rank 0's torch, python, backend, gloo, nccl, cuda",
            "mismatches": "ranks whose versions differ from rank 0's",
            "mismatches[].rank": "the rank",
            "mismatches[].key": "which version (torch, python, ...)",
            "mismatches[].value": "its value there",
            "mismatches[].rank0": "rank 0's value",
            "links": "measured links: every pair of nodes, and two ranks within each node",
            "links[].a": "first rank of the pair",
            "links[].b": "second rank",
            "links[].node_a": "rank a's node",
            "links[].node_b": "rank b's node",
            "links[].level": "inter or intra (node)",
            "links[].gbps": "bandwidth, Gbit/s",
            "links[].latency_us": "one small message's round trip / 2, microseconds",
            "compute": "every rank's matmul rate",
            "compute[].rank": "the rank",
            "compute[].node": "its node",
            "compute[].gflops": "float32 matmul GFLOP/s",
            "suspects": "the slow links and ranks (exit code 1 when any)",
            "suspects[].node": "the node",
            "suspects[].rank": "the rank",
            "suspects[].kind": "link or compute",
            "suspects[].measured": "what was measured (Gbit/s or GFLOP/s)",
            "suspects[].expected": "what was expected, same unit",
        },
    ),
    "plan-sync": Output(
        "ringtree plan ... --sync METHOD [--sweep bandwidth] --json FILE",
        "the keys of `plan` or `plan-dp`, and",
        {
            "sync_model": (
                "which planner's step the methods price: the data-parallel formula or the transformer"
            ),
            "sync": "the `--sync` method's row (the keys of `syncs[]`)",
            "sync.sync": "the method: ddp, powersgd, local-sgd, diloco or streaming-diloco",
            "sync.powersgd_rank": "PowerSGD's rank (null for the other methods)",
            "sync.inner_steps": "inner steps H between syncs (local SGD, DiLoCo; else null)",
            "sync.fragments": "Streaming DiLoCo's fragments F (else null)",
            "sync.overlap_steps": (
                "inner steps T a fragment's all-reduce runs behind (Streaming DiLoCo; else null)"
            ),
            "sync.outer_dtype": "the outer all-reduce's dtype (local SGD, DiLoCo; else null)",
            "sync.replicas": "replica groups (1 for ddp and powersgd)",
            "sync.step_s": "the mean step: the inner step plus the outer sync left exposed, per step",
            "sync.inner_step_s": "one step inside a replica group (DDP or PowerSGD: the whole step)",
            "sync.outer_sync_s": (
                "one outer all-reduce between the replica groups (one fragment's); 0 for ddp and powersgd"
            ),
            "sync.outer_comm_exposed_s": "the outer all-reduce left exposed, averaged per step",
            "sync.dp_comm_s": (
                "the every-step gradient reduction left exposed (DDP inside a replica group, or PowerSGD's)"
            ),
            "sync.slow_link_bytes_per_step": (
                "bytes one node sends to the others per step, averaged (on one node: one rank)"
            ),
            "sync.peak_sync_bytes": "the largest single sync's bytes over that link",
            "sync.peak_bandwidth_gbps": (
                "those bytes over the compute time they may take (T inner steps, at least one), Gbit/s"
            ),
            "sync.compute_utilisation": "the step with no data-parallel communication over `step_s`",
            "sync.samples_per_s": "samples per second, all replicas",
            "syncs": "every method's row, with the same words, DDP first",
            "syncs[].sync": "the method: ddp, powersgd, local-sgd, diloco or streaming-diloco",
            "syncs[].powersgd_rank": "PowerSGD's rank (null for the other methods)",
            "syncs[].inner_steps": "inner steps H between syncs (local SGD, DiLoCo; else null)",
            "syncs[].fragments": "Streaming DiLoCo's fragments F (else null)",
            "syncs[].overlap_steps": (
                "inner steps T a fragment's all-reduce runs behind (Streaming DiLoCo; else null)"
            ),
            "syncs[].outer_dtype": "the outer all-reduce's dtype (local SGD, DiLoCo; else null)",
            "syncs[].replicas": "replica groups (1 for ddp and powersgd)",
            "syncs[].step_s": "the mean step: the inner step plus the outer sync left exposed, per step",
            "syncs[].inner_step_s": "one step inside a replica group (DDP or PowerSGD: the whole step)",
            "syncs[].outer_sync_s": (
                "one outer all-reduce between the replica groups (one fragment's); 0 for ddp and powersgd"
            ),
            "syncs[].outer_comm_exposed_s": "the outer all-reduce left exposed, averaged per step",
            "syncs[].dp_comm_s": (
                "the every-step gradient reduction left exposed (DDP inside a replica group, or PowerSGD's)"
            ),
            "syncs[].slow_link_bytes_per_step": (
                "bytes one node sends to the others per step, averaged (on one node: one rank)"
            ),
            "syncs[].peak_sync_bytes": "the largest single sync's bytes over that link",
            "syncs[].peak_bandwidth_gbps": (
                "those bytes over the compute time they may take (T inner steps, at least one), Gbit/s"
            ),
            "syncs[].compute_utilisation": "the step with no data-parallel communication over `step_s`",
            "syncs[].samples_per_s": "samples per second, all replicas",
            "sync_recommendation": (
                "whether the method pays off against DDP's all-reduce, why, and the convergence caveat"
            ),
            "sweep": "with `--sweep bandwidth`: per method, the bandwidth each compute utilisation needs",
            "sweep_algorithm": (
                "the all-reduce the sweep prices with: the plan's, or for `native` (NCCL's model, fitted "
                "at data-centre bandwidths) `hierarchical`"
            ),
            "sweep[].sync": "the method: ddp, powersgd, local-sgd, diloco or streaming-diloco",
            "sweep[].powersgd_rank": "PowerSGD's rank (null for the other methods)",
            "sweep[].inner_steps": "inner steps H between syncs (local SGD, DiLoCo; else null)",
            "sweep[].fragments": "Streaming DiLoCo's fragments F (else null)",
            "sweep[].overlap_steps": (
                "inner steps T a fragment's all-reduce runs behind (Streaming DiLoCo; else null)"
            ),
            "sweep[].outer_dtype": "the outer all-reduce's dtype (local SGD, DiLoCo; else null)",
            "sweep[].gbps": (
                "per compute utilisation (`50%` ... `99%`), the Gbit/s per NIC between nodes it needs; null "
                "where the network alone cannot reach it"
            ),
        },
    ),
    "plan-search": Output(
        "ringtree plan --search --json FILE",
        "the keys of `plan` for the best layout, and",
        {
            "layouts_fit": "how many layouts fit the GPUs' memory (of those searched)",
            "why": "why the first layout wins, in one line",
            "configurations": (
                "the top ten layouts, each with the keys of `plan`; layouts of the same step and memory are "
                "folded into the first, listed in its `details.alike`"
            ),
        },
    ),
    "trace": Output(
        "ringtree trace PATH... --json FILE",
        "one object: the verdict, then per rank, per collective and the stragglers",
        {
            "verdict": "what to look at first, as the lines the command prints first",
            "world_size": "ranks in the run (the traces' distributedInfo)",
            "device": "gpu (kernels on streams) or cpu (operators and gloo collectives on threads)",
            "steps": "the ProfilerStep numbers analysed on every rank",
            "step_time_s": "the median over ranks of the mean ProfilerStep duration on the host",
            "files": "the trace files read, by rank",
            "ranks": "one entry per rank",
            "ranks[].rank": "the rank",
            "ranks[].file": "its trace file",
            "ranks[].device": "gpu or cpu",
            "ranks[].kernel_s": (
                "HTA's kernel time: from the first busy interval's start to the last one's end, "
                "every stream (GPU) or thread (CPU) merged"
            ),
            "ranks[].compute_s": (
                "the union of compute (communication or memcpy concurrent with compute counts as compute)"
            ),
            "ranks[].non_compute_s": "kernel time - compute - idle: exposed communication + exposed memcpy",
            "ranks[].idle_s": "kernel time less the union of everything busy",
            "ranks[].compute_pct": "compute_s as a percentage of kernel_s (HTA's compute_time_pctg)",
            "ranks[].non_compute_pct": "non_compute_s as a % of kernel_s (HTA's non_compute_time_pctg)",
            "ranks[].idle_pct": "idle_s as a percentage of kernel_s (HTA's idle_time_pctg)",
            "ranks[].comm_overlap_pct": (
                "the share of communication's union that compute covers (HTA's comp_comm_overlap_pctg); "
                "null without communication"
            ),
            "ranks[].comm_s": "the union of communication",
            "ranks[].exposed_comm_s": "communication not covered by compute",
            "ranks[].overlapped_comm_s": "communication covered by compute",
            "ranks[].exposed_memcpy_s": "memcpy and memset (and synchronisation) covered by neither",
            "ranks[].idle_host_wait_s": (
                "idle gaps whose next work the host launched only after the gap began (CPU runs: all idle)"
            ),
            "ranks[].idle_kernel_wait_s": "other idle gaps under 30 us (back-to-back launch delay)",
            "ranks[].idle_other_s": "the rest of the idle time (waits on events, on peers)",
            "ranks[].step_time_s": "the mean ProfilerStep duration on this rank's host, or null",
            "ranks[].steps": "the ProfilerStep numbers analysed on this rank",
            "collectives": "one entry per group, op, size and dtype, the most time first",
            "collectives[].group": (
                "the process group's name (Kineto's `Process Group Name`; 0: the default; unnamed-N: a "
                "group of N ranks in a trace that names none)"
            ),
            "collectives[].op": (
                "all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, reduce, send, recv, "
                "send_recv (a point-to-point kernel the trace does not say more about), barrier"
            ),
            "collectives[].bytes": (
                "nccl-tests' size: the all-reduce's buffer, the all-gather's output, the reduce-scatter's "
                "input, the all-to-all's send buffer"
            ),
            "collectives[].dtype": "element type, e.g. float32",
            "collectives[].group_size": "ranks in the group",
            "collectives[].count": "calls (each matched across the ranks that made it)",
            "collectives[].time_s": "total transfer time: each call's shortest duration among its ranks",
            "collectives[].median_s": "the median call's transfer time",
            "collectives[].wait_s": "total waiting beyond the transfer, each call's averaged over its ranks",
            "collectives[].matched_ranks": (
                "how many ranks' calls were matched "
                "(1: a call's duration includes waiting, busbw a lower bound)"
            ),
            "collectives[].algbw_gbps": "bytes x count / time_s, GB/s",
            "collectives[].busbw_gbps": "algbw x the nccl-tests factor for the op and group size, GB/s",
            "collectives[].model_busbw_gbps": (
                "what the planner's model gives on --cluster/--calibration, or null"
            ),
            "stragglers": "the ranks the others wait for consistently, the costliest first",
            "stragglers[].rank": "the rank",
            "stragglers[].late_s_per_step": (
                "seconds a step the others waited for it (in each matched call it started last: how much "
                "later than the next-latest rank), averaged over the steps analysed"
            ),
            "stragglers[].steps": "the steps in which it kept the others waiting the most",
        },
    ),
    "plan-from-trace": Output(
        "ringtree plan --from-trace DIR --json FILE",
        "the step keys of `plan`, and",
        {
            "from_trace": "the traces read",
            "measured_run_step_s": "the traced run's step: the median rank's mean ProfilerStep",
            "predicted_run_step_s": "the step the planner predicts for the traced run's own layout",
            "speedup": "predicted throughput on the cluster over the traced run's",
            "traced_compute_s": "compute per step: the measured step less its exposed communication",
            "traced_grad_bytes": "bytes all-reduced per step (the gradients)",
            "traced_overlap_pct": "how much of the run's communication overlapped compute",
            "traced_wait_s": (
                "per step, the run's exposed communication beyond what the planner predicts for its "
                "own layout (ranks waiting for each other): kept in the plan"
            ),
            "cluster": "the modelled cluster",
        },
    ),
    "plan-from-run": Output(
        "ringtree plan --from-run RUN.json --json FILE",
        "the step keys of `plan` (a run that compressed with PowerSGD or ran a --sync other than ddp: "
        "also the keys of `plan-sync`, its own method's row first), and",
        {
            "speedup": "predicted throughput on the cluster over the measured run's",
            "speedup_vs_predicted_run": (
                "predicted throughput on the cluster over the predicted run's (the model against itself)"
            ),
            "measured_run_step_s": "the finished run's measured step",
            "predicted_run_step_s": "the step the planner predicts for the run's own shape",
            "from_run": "the summary file read",
            "zero": "the run's ZeRO stage",
            "cluster": "the modelled cluster",
            "explain": "the bound per link level, the bottleneck and its share, the printed lines",
        },
    ),
}


def keys(name: str) -> list[str]:
    """The documented keys of one output, in the registry's order."""
    return list(OUTPUTS[name].keys)


def markdown() -> str:
    """The reference page: one table per output."""
    lines = [
        "# JSON output",
        "",
        "<!-- Generated by `python -m ringtree.json_keys` from ringtree/json_keys.py: edit that file. -->",
        "",
        "Every command that takes `--json FILE` (calibrate: `--out FILE`) writes one key per quantity.",
        "A list's items are shown as `list[].key`, a nested object's keys as `object.key`.",
    ]
    for name, out in OUTPUTS.items():
        lines += ["", f"## {name}", "", f"`{out.command}`: {out.shape}", "", "| key | meaning |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in out.keys.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
