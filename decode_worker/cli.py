"""`decode-worker` command line: argv -> settings -> the chosen subcommand.

Each subcommand lives in its own module and exposes `run(args, loaded) -> int`; this file only
parses arguments and resolves settings.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from decode_worker.errors import ConfigError, DecodeWorkerError
from decode_worker.settings import LoadedSettings, load_settings

# subcommand -> (module with run(args, loaded), one-line help)
_SUBCOMMANDS = {
    "serve": ("decode_worker.daemon.decode.serve", "run the decode worker daemon"),
    "prefill": ("decode_worker.daemon.prefill.main", "run the reference prefill peer"),
    "demo": ("decode_worker.daemon.demo.main",
             "prefill peer + decode worker + a multi-turn chat demo"),
    "make-model": ("decode_worker.device.default_model", "write the tiny default gpt-oss model"),
    "models": ("decode_worker.device.model.catalog",
               "list the supported model families: what each reads, what serves it"),
    "config": ("decode_worker.cli", "print the resolved settings and where each came from"),
    "harmony-vocab": ("decode_worker.daemon.shared.harmony_vocab",
                      "write the o200k_base.tiktoken directory smg needs for gpt-oss (harmony) "
                      "without network: point TIKTOKEN_ENCODINGS_BASE at it"),
    "spec-sim": ("decode_worker.daemon.spec_sim",
                 "replay a trace through the speculative drafters: what they would earn"),
}
# SGLang's speculative flags (serve, spec-sim) -> (settings key, type)
_SPEC_FLAGS: dict[str, tuple[str, type]] = {
    "--speculative-algorithm": ("speculative.algorithm", str),
    "--speculative-num-draft-tokens": ("speculative.num_draft_tokens", int),
    "--speculative-ngram-min-match-window-size": ("speculative.ngram_min_match_window_size",
                                                  int),
    "--speculative-ngram-max-match-window-size": ("speculative.ngram_max_match_window_size",
                                                  int),
    "--speculative-ngram-capacity": ("speculative.ngram_capacity", int),
    "--speculative-suffix-max-tree-depth": ("speculative.suffix_max_tree_depth", int),
    "--speculative-suffix-max-cached-requests": ("speculative.suffix_max_cached_requests", int),
    "--speculative-suffix-max-spec-factor": ("speculative.suffix_max_spec_factor", float),
    "--speculative-suffix-min-token-prob": ("speculative.suffix_min_token_prob", float),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decode-worker",
        description="Decode worker for prefill/decode disaggregated serving of sliding-window "
        "hybrid and full-attention models (gpt-oss, Llama 3, Qwen3, Qwen3-MoE, Gemma 3). "
        "Settings: defaults < --config TOML < DECODE_WORKER_<SECTION>__<KEY> env < "
        "--set/flags.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in _SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_common(p)
        if name in ("serve", "prefill", "demo"):
            p.add_argument("--host", help="bind address (server.host)")
            p.add_argument("--port", type=int, help="HTTP port (server.port; 0 = any free port)")
            p.add_argument("--print-config", action="store_true",
                           help="print the settings these arguments resolve to (as `decode-worker "
                           "config` does) and exit")
        if name in ("serve", "prefill"):
            p.add_argument("--ports-file", type=Path, metavar="PATH",
                           help="once serving, write the bound ports to PATH as JSON (http; "
                           "grpc with --grpc-port; prefill: bootstrap, and rank with "
                           "--protocol sglang; serve: kv_events, kv_events_replay when bound): "
                           "for supervisors and tests that start it with port 0")
        if name in ("serve", "prefill"):
            p.add_argument("--grpc-port", type=int,
                           help="smg's gRPC worker protocol (SglangScheduler) on this port beside "
                           "HTTP (server.grpc_port; off when unset)")
        if name == "serve":
            p.add_argument("--kv-events-config", metavar="JSON",
                           help="SGLang's KV-event publisher config, e.g. "
                           "'{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\"}' "
                           "(kv_events.config)")
        if name in ("prefill", "demo"):
            p.add_argument("--bootstrap-port", type=int,
                           help="bootstrap port: ZMQ (native) or SGLang's HTTP bootstrap "
                           "server (transfer.bootstrap_port)")
        if name == "prefill":
            p.add_argument("--protocol", choices=("native", "sglang"),
                           help="protocol served on the bootstrap port: native (ZMQ) or sglang "
                           "(SGLang 0.5.23's, NIXL backend) (transfer.prefill_protocol)")
        if name == "demo":
            p.add_argument("--turns", type=int, default=4, help="chat turns per conversation")
            p.add_argument("--conversations", type=int, default=4, help="parallel conversations")
            p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer")
            p.add_argument("--family", metavar="NAME",
                           help="run a tiny seeded random model of this family (gpt-oss, "
                           "llama, qwen3, qwen3_moe, gemma3; `decode-worker models` lists them), "
                           "written once under model.cache_dir; default: --model, else gpt-oss")
            p.add_argument("--device-pages", type=int, default=None,
                           help="the decode worker's full pool in pages (default: small enough "
                           "that the chats outgrow it, so the host tier shows; 0: its own "
                           "sizing)")
        if name == "make-model":
            p.add_argument("dir", type=Path, help="output directory (Hugging Face layout)")
        if name in ("config", "models"):
            p.add_argument("--json", action="store_true", help="print JSON instead of text")
        if name == "harmony-vocab":
            p.add_argument("--out", type=Path, required=True, metavar="DIR",
                           help="directory to write o200k_base.tiktoken into (created if "
                           "missing)")
            p.add_argument("--from", dest="source", type=Path, metavar="FILE",
                           help="copy and verify this o200k_base.tiktoken instead of rebuilding "
                           "it from the quicktok-v1 package")
        if name in ("serve", "spec-sim"):
            _add_speculative(p)
        if name == "spec-sim":
            p.add_argument("trace", type=Path, help="JSONL: {id, conversation, prompt, "
                           "response} per line, text or token ids")
    return parser


def _add_speculative(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("speculative decoding (SGLang's flags; see docs/DEPLOY.md)")
    for flag, (key, kind) in _SPEC_FLAGS.items():
        metavar = "NGRAM|SUFFIX" if kind is str else kind.__name__.upper()
        group.add_argument(flag, type=kind, metavar=metavar, help=f"({key})")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML settings file")
    p.add_argument("--model", type=Path, help="local Hugging Face model directory (model.path)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable); values are parsed as JSON when they can be",
    )


def resolve(args: argparse.Namespace) -> LoadedSettings:
    """Turn parsed arguments into validated settings; raises ConfigError."""
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides[key.strip()] = _parse_value(raw)
    named = {
        "model.path": getattr(args, "model", None),
        "server.host": getattr(args, "host", None),
        "server.port": getattr(args, "port", None),
        "server.grpc_port": getattr(args, "grpc_port", None),
        "transfer.bootstrap_port": getattr(args, "bootstrap_port", None),
        "transfer.prefill_protocol": getattr(args, "protocol", None),
        "kv_events.config": getattr(args, "kv_events_config", None),
    }
    for flag, (key, _) in _SPEC_FLAGS.items():
        named[key] = getattr(args, flag[2:].replace("-", "_"), None)
    overrides.update({k: v for k, v in named.items() if v is not None})
    return load_settings(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        loaded = resolve(args)
    except ConfigError as exc:
        print(f"decode-worker: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=loaded.settings.server.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module_name, _ = _SUBCOMMANDS[args.command]
    if args.command == "config" or getattr(args, "print_config", False):
        return run_config(args, loaded)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"decode-worker {args.command}: not built yet", file=sys.stderr)
        return 2
    try:
        return int(module.run(args, loaded))
    except ConfigError as exc:
        print(f"decode-worker {args.command}: configuration error: {exc}", file=sys.stderr)
        return 2
    except DecodeWorkerError as exc:
        print(f"decode-worker {args.command}: {exc}", file=sys.stderr)
        return 1


def run_config(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Print every resolved setting with its source; secrets are redacted."""
    values = loaded.settings.model_dump(mode="json")
    rows = []
    for section, keys in values.items():
        for key, value in keys.items():
            dotted = f"{section}.{key}"
            shown = "**********" if key in _SECRET_KEYS and value is not None else value
            rows.append((dotted, shown, loaded.sources.get(dotted, "default")))
    if getattr(args, "json", False):
        print(json.dumps({k: {"value": v, "source": s} for k, v, s in rows}, indent=2))
        return 0
    width = max(len(k) for k, _, _ in rows)
    for dotted, shown, source in rows:
        print(f"{dotted:<{width}} = {json.dumps(shown)}  # {source}")
    return 0


_SECRET_KEYS = frozenset({"api_key"})


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
