"""The `rollout-service` console script: serve, prepare-model, demo, check-stubs."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def _serve_args(sub) -> None:
    p = sub.add_parser("serve", help="run the gRPC service (and its HTTP port) in front of vLLM engines")
    p.add_argument("--config", help="TOML or JSON config file (see docs/configuration.md)")
    p.add_argument("--model", help="local Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--engines", type=int, help="number of engines in this process's pool (default 1)")
    p.add_argument("--host", help="bind address (default 127.0.0.1; others need authentication, see security)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default 50051; 0 picks a free one)")
    p.add_argument("--http-port", type=int, help="HTTP port for /healthz /readyz /metrics /v1/status (default 8000)")
    p.add_argument("--max-queue", type=int, help="sequences admitted at once before RESOURCE_EXHAUSTED")
    p.add_argument("--max-message-mb", type=int, help="largest request message in MiB (default 64)")
    p.add_argument("--max-new-tokens", type=int, help="cap on sampling.max_tokens (default: the context length)")
    p.add_argument("--max-streams-per-client", type=int, help="concurrent Generate streams per client (default 64)")
    p.add_argument("--token-file", help="file holding the client bearer token (or env ROLLOUT_AUTH_TOKEN)")
    p.add_argument("--admin-token-file", help="file holding the admin bearer token for weight/drafter pushes "
                                              "(or env ROLLOUT_ADMIN_TOKEN)")
    p.add_argument("--tls-cert", help="PEM server certificate (TLS on both ports)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA that client certificates must chain to (mutual TLS)")
    p.add_argument("--allow-insecure-remote", action="store_true", default=None,
                   help="serve a non-loopback --host without authentication (trusted networks only)")
    p.add_argument("--weights-root", action="append", metavar="DIR",
                   help="a directory LoadWeights may read weights below (repeatable; default: the service's cache "
                        "directory, $ROLLOUT_SERVICE_HOME or ~/.cache/rollout-service)")
    p.add_argument("--ray-address", help="run the engines as Ray actors on this cluster (auto: the local one)")
    p.add_argument("--ray-cpus-per-engine", type=float, help="CPUs reserved per engine actor (default 1)")
    p.add_argument("--ray-gpus-per-engine", type=int, help="GPUs per engine actor (GPU nodes; default 0)")
    p.add_argument("--tensor-parallel-size", type=int, help="GPUs each engine shards the model over (default 1)")
    p.add_argument("--max-model-len", type=int, help="context length per sequence (default 2048)")
    p.add_argument("--max-num-seqs", type=int, help="sequences each engine batches at once (default 64)")
    p.add_argument("--kv-cache-gb", type=float, help="KV cache per engine in GiB on CPU (default 2)")
    p.add_argument("--dtype", help="auto, bfloat16, float16 or float32")
    p.add_argument("--weight-reload", choices=("shadow", "in_place"),
                   help="commits: prepare beside the served weights and pause only to swap (shadow, default), "
                        "or load while paused (in_place: no second copy of the weights in memory)")
    p.add_argument("--speculation", choices=["none", "draft_model", "eagle3", "ngram", "mtp"],
                   help="speculative decoding method (default none)")
    p.add_argument("--draft-model", help="drafter directory for draft_model / eagle3")
    p.add_argument("--num-speculative-tokens", type=int, help="k, tokens drafted per step (default 3)")
    p.add_argument("--draft-sampling", choices=["probabilistic", "greedy"], help="how the drafter samples")
    p.add_argument("--k-by-batch-size", metavar="FIRST-LAST:K,...",
                   help="k by the engine's running sequences, e.g. 1-8:3,9-16:1,17-:0 (k 0: no drafting there; "
                        "default: k at every batch size)")
    p.add_argument("--k-control", choices=["auto", "fixed"],
                   help="without --k-by-batch-size: choose k (0 to --num-speculative-tokens) each engine step from "
                        "measured step times and acceptance (auto, default), or draft k every step (fixed)")
    p.add_argument("--draft-cost", type=float, help="drafter step / target step, as bench/speculation.py measures "
                                                      "it; enables the expected-speedup estimate and warning")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rollout-service", description="Rollout-as-a-service for RL trainers.")
    ap.add_argument("--log-level", default=os.environ.get("ROLLOUT_LOG_LEVEL", "INFO"))
    sub = ap.add_subparsers(dest="cmd", required=True)
    _serve_args(sub)
    p = sub.add_parser("prepare-model", help="convert the packaged SmolLM2-135M-Instruct GGUF into a cached "
                                             "Hugging Face directory (once, ~30 s)")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    d = sub.add_parser("demo", help="start the service on the default model and stream a batch of samples")
    d.add_argument("--model", help="model directory (default: embedded SmolLM2-135M-Instruct)")
    d.add_argument("--prompts", type=int, default=8)
    d.add_argument("--n", type=int, default=4)
    d.add_argument("--max-tokens", type=int, default=96)
    sub.add_parser("check-stubs", help="exit 1 when the committed gRPC stubs are stale")
    from rollout_service.perfmodel.simulate import add_args as simulate_args

    simulate_args(sub.add_parser("simulate", help="project speculation and RL step times onto GPUs (or this CPU) "
                                                  "from per-position acceptance: the performance model"))
    pd = sub.add_parser("prepare-drafter", help="train a drafter for the default model on its own samples of the "
                                                 "trainer task (once, cached; minutes on CPU): a distilled 2-layer "
                                                 "draft model or an EAGLE-3 head")
    pd.add_argument("--kind", default="draft_model", choices=["draft_model", "eagle3"])
    pd.add_argument("--model", help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    pd.add_argument("--out", help="output directory (default: the cache)")
    pd.add_argument("--layers", type=int, default=2, help="draft_model: decoder layers kept")
    pd.add_argument("--prompts", type=int, default=192)
    pd.add_argument("--max-tokens", type=int, default=128)
    pd.add_argument("--epochs", type=int, help="default: 4 (draft_model), 10 (eagle3)")
    pd.add_argument("--force", action="store_true")
    v = sub.add_parser("verify-lossless", help="prove speculative sampling matches plain sampling (G-tests) and "
                                               "that returned log-probs match an independent forward pass")
    v.add_argument("--model", help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    v.add_argument("--method", default="draft_model", choices=["draft_model", "eagle3", "ngram", "mtp"])
    v.add_argument("--draft-model", help="drafter directory (draft_model, eagle3)")
    v.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    v.add_argument("--draft-sampling", default="probabilistic", choices=["probabilistic", "greedy"])
    v.add_argument("--k-by-batch-size", metavar="FIRST-LAST:K,...", help="k by batch size, as for serve")
    v.add_argument("--k-control", default="fixed", choices=["auto", "fixed"],
                   help="as for serve (default fixed here: every step drafts k, the strictest test)")
    v.add_argument("--samples", type=int, default=400, help="samples per prompt per side")
    v.add_argument("--max-tokens", type=int, default=4, help="continuation length tested")
    v.add_argument("--temperature", type=float, default=1.0)
    v.add_argument("--top-k", type=int, default=10)
    v.add_argument("--top-p", type=float, default=1.0)
    v.add_argument("--alpha", type=float, default=1e-3, help="family-wise significance (Bonferroni)")
    v.add_argument("--prompts", nargs="*", default=["What is 12 + 30?", "Name a color."],
                   help="prompt texts (chat template applied)")
    return ap


def resolve_model(model: str | None) -> str:
    from rollout_service.models import is_model_dir, prepare_default_model

    if not model:
        return str(prepare_default_model())
    from pathlib import Path

    if not is_model_dir(Path(model)):
        raise SystemExit(f"--model {model}: not a Hugging Face model directory (needs config.json and "
                         "*.safetensors); nothing is downloaded from a hub")
    return model


def cmd_serve(args) -> int:
    from rollout_service.config import ConfigError, load_config, parse_k_schedule
    from rollout_service.server.app import serve

    try:
        k_schedule = parse_k_schedule(args.k_by_batch_size) if args.k_by_batch_size else None
        cfg = load_config(args.config, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                          engines=args.engines, max_queue=args.max_queue, max_new_tokens=args.max_new_tokens,
                          max_message_mb=args.max_message_mb,
                          max_streams_per_client=args.max_streams_per_client,
                          **{"engine.model": args.model, "engine.max_model_len": args.max_model_len,
                             "engine.max_num_seqs": args.max_num_seqs, "engine.kv_cache_gb": args.kv_cache_gb,
                             "engine.dtype": args.dtype, "engine.weight_reload": args.weight_reload,
                             "engine.speculation.method": args.speculation,
                             "engine.speculation.model": args.draft_model,
                             "engine.speculation.num_speculative_tokens": args.num_speculative_tokens,
                             "engine.speculation.draft_sampling": args.draft_sampling,
                             "engine.speculation.draft_cost": args.draft_cost,
                             "engine.speculation.k_by_batch_size": k_schedule,
                             "engine.speculation.k_control": args.k_control,
                             "security.token_file": args.token_file, "security.admin_token_file": args.admin_token_file,
                             "security.tls_cert": args.tls_cert, "security.tls_key": args.tls_key,
                             "security.tls_client_ca": args.tls_client_ca,
                             "security.allow_insecure_remote": args.allow_insecure_remote,
                             "security.weights_roots": args.weights_root,
                             "ray.address": args.ray_address, "ray.cpus_per_engine": args.ray_cpus_per_engine,
                             "ray.gpus_per_engine": args.ray_gpus_per_engine,
                             "engine.tensor_parallel_size": args.tensor_parallel_size})
    except ConfigError as e:
        print(f"rollout-service: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(cfg, resolve_model(cfg.engine.model)))
    except ConfigError as e:
        print(f"rollout-service: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_verify_lossless(args) -> int:
    from rollout_service.config import ConfigError, load_config, parse_k_schedule
    from rollout_service.model_info import ModelInfo
    from rollout_service.drafting.lossless import check_lossless

    model = resolve_model(args.model)
    info = ModelInfo.load(model, 2048)
    prompts = [info.encode(p, chat=True) for p in args.prompts]
    try:
        spec = load_config(**{"engine.speculation.method": args.method,
                              "engine.speculation.model": args.draft_model,
                              "engine.speculation.num_speculative_tokens": args.num_speculative_tokens,
                              "engine.speculation.draft_sampling": args.draft_sampling,
                              "engine.speculation.k_by_batch_size":
                                  parse_k_schedule(args.k_by_batch_size) if args.k_by_batch_size else None,
                              "engine.speculation.k_control": args.k_control,
                              }).engine.speculation
    except ConfigError as e:
        print(f"rollout-service: {e}", file=sys.stderr)
        return 2
    report = check_lossless(model, spec, prompts, samples=args.samples, max_tokens=args.max_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, alpha=args.alpha)
    print(report.render())
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    from rollout_service.launcher import die_with_parent

    die_with_parent()                # started by launcher.ServiceProcess: end with the process that started it
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.cmd == "serve":
        return cmd_serve(args)
    if args.cmd == "prepare-model":
        from rollout_service.models import prepare_default_model

        print(prepare_default_model(force=args.force))
        return 0
    if args.cmd == "demo":
        from rollout_service.demo import run_demo

        return run_demo(resolve_model(args.model), args.prompts, args.n, args.max_tokens)
    if args.cmd == "prepare-drafter":
        from pathlib import Path

        from rollout_service.drafting.drafters import prepare_draft_model, prepare_eagle3_head

        out = Path(args.out) if args.out else None
        if args.kind == "eagle3":
            print(prepare_eagle3_head(resolve_model(args.model), out, prompts=args.prompts,
                                      max_tokens=args.max_tokens, epochs=args.epochs or 10, force=args.force))
        else:
            print(prepare_draft_model(resolve_model(args.model), out, layers=args.layers, prompts=args.prompts,
                                      max_tokens=args.max_tokens, epochs=args.epochs or 4, force=args.force))
        return 0
    if args.cmd == "verify-lossless":
        return cmd_verify_lossless(args)
    if args.cmd == "simulate":
        from rollout_service.perfmodel.simulate import run as simulate

        return simulate(args)
    if args.cmd == "check-stubs":
        from rollout_service.protogen import main as protogen_main

        return protogen_main(["--check"])
    return 2


if __name__ == "__main__":
    sys.exit(main())
