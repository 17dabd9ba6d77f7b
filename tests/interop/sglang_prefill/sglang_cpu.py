"""Run SGLang 0.5.23's own PD transfer classes on a CPU-only machine (venv-only helper).

Imported by prefill_server.py, selfcheck.py and capture_frames.py, which run under the
interpreter of scripts/setup_sglang.sh's venv. Never imported by the main environment.

What it sets up is docs/PROTOCOLS.md, "Running SGLang's own code on a CPU". The work-arounds,
each installed by `install_workarounds`:
  1. pp_group: `NixlKVManager.__init__` (PREFILL) reads `get_parallel().pp_group`, which only
     exists once torch process groups are built by a scheduler. A one-rank stand-in is stated
     with `override_permanently` (pp_size is 1 here).
  2. host memory: SGLang registers and addresses some regions as "VRAM" (the SWA state pools
     always; the full KV entries by `kv_data_mem_kinds`, default VRAM). UCX on a CPU-only box
     refuses VRAM registrations of host memory (NIXL_ERR_BACKEND). On this machine every region
     is host memory, so the NIXL agent's descriptor builders map "VRAM" to "DRAM". The wire
     frames are untouched: a decode still announces what SGLang would (VRAM by default).
  3. ports: SGLang binds its ZMQ PULL sockets to a random port in 49152-65535; tests here may
     bind only a given range, so the bind helper picks from `SGLANG_CPU_ZMQ_PORTS` (lo-hi).
     UCX's own TCP listeners are kept in `UCX_TCP_PORT_RANGE` by `prepare_env`.
  4. idle CPU: nixl's Python wrapper (1.5) builds its agent config with `pthrDelay = 0`, so
     each agent's progress thread spins a core even when idle (measured here: 100 % of a core
     per process). The bindings' agent constructor is wrapped to set
     `SGLANG_CPU_NIXL_PROGRESS_DELAY_US` (default 100, as decode-worker's own default).

The model geometry (`Layout`) and the synthetic KV (`kv_bits`) live in layout.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from layout import Layout

DEFAULT_ZMQ_PORTS = "18230-18259"
DEFAULT_UCX_PORTS = "18260-18299"


def prepare_env() -> None:
    """Loopback-only NIXL/UCX and SGLang settings; call before importing sglang or nixl."""
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TCP_PORT_RANGE", DEFAULT_UCX_PORTS)
    os.environ.setdefault("SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX")
    os.environ.setdefault("SGLANG_CPU_ZMQ_PORTS", DEFAULT_ZMQ_PORTS)
    os.environ.setdefault("SGLANG_CPU_NIXL_PROGRESS_DELAY_US", "100")
    # keep the CPU-side noise down: one intra-op thread, no tokenizer parallelism
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---- work-arounds ---------------------------------------------------------------------------
@dataclass
class _OneRankGroup:
    """Stand-in for the pipeline-parallel group of a pp_size=1 engine."""

    world_size: int = 1
    rank_in_group: int = 0
    is_first_rank: bool = True
    is_last_rank: bool = True
    ranks: list[int] = field(default_factory=lambda: [0])


def _port_range() -> tuple[int, int]:
    lo, hi = os.environ["SGLANG_CPU_ZMQ_PORTS"].split("-")
    return int(lo), int(hi)


def install_workarounds() -> None:
    """Apply the four work-arounds of the module docstring (after `publish_server_args`)."""
    import importlib

    import nixl._api as nixl_api
    import zmq
    from sglang.srt.disaggregation.common import conn as common_conn
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.network import config_socket

    get_parallel().override_permanently(pp_group=_OneRankGroup())

    agent_cls = nixl_api.nixl_agent
    if not getattr(agent_cls, "_cpu_host_memory_patch", False):
        for name in ("get_reg_descs", "get_xfer_descs"):
            original = getattr(agent_cls, name)

            def host_only(self: Any, descs: Any, mem_type: Any = None, *,
                          _f: Any = original) -> Any:
                return _f(self, descs, "DRAM" if mem_type == "VRAM" else mem_type)

            setattr(agent_cls, name, host_only)
        prep = agent_cls.prep_xfer_dlist

        def prep_host_only(self: Any, agent_name: Any, xfer_list: Any, mem_type: Any = None,
                           backends: Any = (), *, _f: Any = prep) -> Any:
            return _f(self, agent_name, xfer_list, "DRAM" if mem_type == "VRAM" else mem_type,
                      list(backends))

        agent_cls.prep_xfer_dlist = prep_host_only
        agent_cls._cpu_host_memory_patch = True

        bindings = importlib.import_module(agent_cls.__module__).nixlBind
        real_agent = bindings.nixlAgent
        delay_us = int(os.environ["SGLANG_CPU_NIXL_PROGRESS_DELAY_US"])

        def agent_with_delay(name: str, config: Any) -> Any:
            config.pthrDelay = delay_us
            return real_agent(name, config)

        bindings.nixlAgent = agent_with_delay

    def bind_in_range(context: Any, socket_type: Any, host: str | None = None,
                      restrict_peers: bool = False) -> tuple[int, Any]:
        sock = context.socket(socket_type)
        config_socket(sock, socket_type)
        lo, hi = _port_range()
        port = sock.bind_to_random_port(f"tcp://{host or '127.0.0.1'}", min_port=lo,
                                        max_port=hi + 1, max_tries=200)
        return port, sock

    common_conn.get_zmq_socket_on_host = bind_in_range
    _ = zmq  # imported for its side effect order: pyzmq before sglang's sockets


def record_route_puts() -> None:
    """If `SGLANG_CPU_RECORD_ROUTE_PUT` names a file, append each rank's PUT /route to it.

    For capture_frames.py: the registration a prefill rank sends its bootstrap server.
    """
    path = os.environ.get("SGLANG_CPU_RECORD_ROUTE_PUT")
    if not path:
        return
    import json

    from sglang.srt.disaggregation.common import conn as common_conn

    real_put = common_conn.requests.put
    if getattr(real_put, "records_route", False):
        return

    def put(url: str, **kwargs: Any) -> Any:
        resp = real_put(url, **kwargs)
        with open(path, "a") as out:
            out.write(json.dumps({"url": url, "json": kwargs.get("json"),
                                  "status": resp.status_code, "text": resp.text}) + "\n")
        return resp

    put.records_route = True  # type: ignore[attr-defined]
    common_conn.requests.put = put


# ---- SGLang objects ---------------------------------------------------------------------------
def publish_server_args(mode: str, layout: Layout, bootstrap_port: int, tp_rank: int = 0,
                        host: str = "127.0.0.1") -> Any:
    """ServerArgs for one rank of a `mode` ("prefill"/"decode") engine, published process-wide."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    # "dummy" is the one model path whose arguments resolve without a model config; it also
    # skips the later resolution hooks, so what they would resolve for PD is stated here:
    # load_balance_method "auto" -> follow_bootstrap_room (prefill) / round_robin (decode),
    # which the bootstrap server's PrefillServerInfo.follow_bootstrap_room reports.
    server_args = ServerArgs(
        model_path="dummy", disaggregation_mode=mode,
        disaggregation_transfer_backend="nixl", device="cpu", host=host,
        disaggregation_bootstrap_port=bootstrap_port, skip_tokenizer_init=True,
        page_size=layout.page_size, tp_size=layout.tp_size if mode == "prefill" else 1,
        load_balance_method="follow_bootstrap_room" if mode == "prefill" else "round_robin",
    )
    rc.publish(server_args, role="scheduler",
               ranks=rc.SpawnRanks(world_rank=tp_rank, dp_rank=None, gpu_id=0))
    return server_args


def build_pool(layout: Layout, heads: int | None = None) -> Any:
    """SGLang's own SWAKVPool on the CPU: full layers + SWA layers, `heads` KV heads each; for
    a model without sliding layers its MHATokenToKVPool (every layer full), as SGLang builds
    one for an ordinary model."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    if not layout.sliding_layer_ids:
        return MHATokenToKVPool(
            size=layout.pool_tokens, page_size=layout.page_size, dtype=layout.torch_dtype(),
            head_num=heads or layout.heads_per_rank, head_dim=layout.head_dim,
            layer_num=layout.num_layers, device="cpu", enable_memory_saver=False)

    return SWAKVPool(
        size=layout.pool_tokens, size_swa=layout.swa_pool_tokens, page_size=layout.page_size,
        dtype=layout.torch_dtype(), head_num=heads or layout.heads_per_rank,
        head_dim=layout.head_dim, swa_attention_layer_ids=list(layout.sliding_layer_ids),
        full_attention_layer_ids=layout.full_layer_ids, device="cpu",
    )


def build_metadata(layout: Layout, server_args: Any) -> Any:
    """MetadataBuffers as the scheduler builds them without speculative decoding."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(
        layout.metadata_rows, hidden_size=16, hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=server_args.sampling_mask_max_tokens,
    )


def build_kv_args(mode: str, layout: Layout, pool: Any, metadata: Any, tp_rank: int) -> Any:
    """KVArgs filled as PrefillBootstrapQueue/DecodePreallocQueue._init_kv_manager fill them."""
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        TransferBackend,
        build_kv_layer_ids,
        get_kv_class,
        get_kv_transfer_buf_infos,
        get_pd_kv_layout,
        setup_state_kv_args,
    )
    from sglang.srt.runtime_context import get_device, get_disagg, get_model, get_parallel

    kv_args = get_kv_class(TransferBackend.NIXL, KVClassType.KVARGS)()
    kv_args.engine_rank = tp_rank
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = get_parallel().dp_rank
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = get_model().kv_cache_dtype
    kv_args.kv_layout = get_pd_kv_layout(pool)
    ptrs, lens, item_lens = get_kv_transfer_buf_infos(pool)
    if mode == "prefill":
        kv_args.prefill_start_layer = pool.start_layer
        kv_args.prefill_end_layer = getattr(pool, "end_layer", None)
    else:
        # DecodePreallocQueue sets the NIXL memory kinds; VRAM is what a GPU decode announces
        kv_args.kv_data_mem_kinds = ["VRAM"] * len(ptrs)
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, item_lens
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=pool, draft_token_to_kv_pool=None, num_draft_entries=0,
        num_hidden_layers=layout.num_layers,
    )
    kv_args.kv_head_num = pool.head_num
    kv_args.total_kv_head_num = layout.kv_heads
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
        metadata.get_buf_infos()
    )
    kv_args.ib_device = get_disagg().disaggregation_ib_device
    kv_args.gpu_id = get_device().gpu_id
    setup_state_kv_args(kv_args, pool, None, layout.num_layers, req_to_token_pool=None)
    return kv_args


def build_manager(mode: str, kv_args: Any, server_args: Any) -> Any:
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    dmode = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    return NixlKVManager(kv_args, dmode, server_args, is_mla_backend=False)


def aux_request(room: int, metadata_row: int, first_token: int, cached_tokens: int = 0,
                logprob: float | None = None,
                top_logprobs: list[tuple[int, float]] | None = None) -> Any:
    """The fields of a `Req` that `MetadataBuffers.set_buf` reads, for a synthetic forward."""
    return SimpleNamespace(
        metadata_buffer_index=metadata_row, output_ids=[first_token],
        cached_tokens=cached_tokens, cached_tokens_device=cached_tokens,
        cached_tokens_host=0, cached_tokens_storage=0,
        get_mm_token_counts=lambda: (0, 0, 0),
        return_logprob=logprob is not None or bool(top_logprobs),
        logprob=SimpleNamespace(
            output_token_logprobs_val=[logprob] if logprob is not None else [],
            output_token_logprobs_idx=[first_token] if logprob is not None else [],
            output_top_logprobs_val=[[v for _, v in top_logprobs]] if top_logprobs else [],
            output_top_logprobs_idx=[[t for t, _ in top_logprobs]] if top_logprobs else [],
        ),
        return_sampling_mask=False, hidden_states_tensor=None, bootstrap_room=room,
    )
