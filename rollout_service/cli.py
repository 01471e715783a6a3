"""The `rollout-service` console script: serve, prepare-model, demo, check-stubs."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from pathlib import Path


def add_flag(parser, path: str, *names: str, **overrides) -> str:
    """The flag of config field `path` (config.py: its type, choices, help and default say everything; `names`
    and `overrides` adapt it for another command). Returns the argparse dest."""
    from rollout_service.config import field

    f = field(path)
    kw = {"help": f.doc.replace("`", "") + (f" (default: {f.shown or f.default})".replace("`", "")
                                             if f.shown or f.default not in ("", [], None) else "")}
    kind = type(f.type).__name__                      # msgspec.inspect: IntType, ListType, ...
    if kind == "BoolType":
        kw.update(action="store_true", default=None)
    elif kind == "ListType" and type(f.type.item_type).__name__ == "StrType":
        kw.update(action="append")                    # repeatable
    else:                                             # other lists (k_by_batch_size) are parsed from one string
        kw["type"] = {"IntType": int, "FloatType": float}.get(kind, str)
    if f.choices:
        kw["choices"] = f.choices
    if f.metavar:
        kw["metavar"] = f.metavar
    kw.update(overrides)
    return parser.add_argument(*(names or (f.flag,)), **kw).dest


SERVE_FLAGS: dict[str, str] = {}       # argparse dest -> config field path, filled by _serve_args


def _serve_args(sub) -> None:
    from rollout_service.config import fields

    p = sub.add_parser("serve", help="run the gRPC service (and its HTTP port) in front of vLLM engines")
    p.add_argument("--config", help="TOML or JSON config file (see docs/configuration.md)")
    for f in fields():
        if f.flag:
            SERVE_FLAGS[add_flag(p, f.path)] = f.path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rollout-service", description="Rollout-as-a-service for RL trainers.")
    ap.add_argument("--log-level", default=os.environ.get("ROLLOUT_LOG_LEVEL", "INFO"))
    sub = ap.add_subparsers(dest="cmd", required=True)
    _serve_args(sub)
    p = sub.add_parser("prepare-model", help="convert the packaged SmolLM2-135M-Instruct GGUF into a cached "
                                             "Hugging Face directory (once, ~30 s); prints its directory")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.add_argument("--moe", action="store_true",
                   help="the mixture-of-experts policy instead: SmolLM2 sparsely upcycled into a Mixtral (moe_model.py;"
                        " ~20-60 s once); `--model moe` of serve, demo and rollout-grpo prepares and names it")
    p.add_argument("--experts", type=int, default=4, help="--moe: experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="--moe: experts routed per token")
    d = sub.add_parser("demo", help="start the service on the default model and stream a batch of samples")
    d.add_argument("--model", help="model directory, or `moe` (prepare-model --moe) (default: embedded "
                                   "SmolLM2-135M-Instruct)")
    d.add_argument("--prompts", type=int, default=8)
    d.add_argument("--n", type=int, default=4)
    d.add_argument("--max-tokens", type=int, default=96)
    sub.add_parser("check-stubs", help="exit 1 when the committed gRPC stubs are stale")
    from rollout_service.perfmodel.simulate import add_args as simulate_args

    simulate_args(sub.add_parser("simulate", help="project speculation and RL step times onto GPUs (or this CPU) "
                                                  "from per-position acceptance: the performance model"))
    pd = sub.add_parser("prepare-drafter",
                        help="train a drafter for the default model on its own samples of the arithmetic task, the "
                             "bundled trainer's (once, cached; minutes on CPU): a distilled 2-layer draft model or "
                             "an EAGLE-3 head; prints its directory")
    pd.add_argument("--kind", default="draft_model", choices=["draft_model", "eagle3"])
    pd.add_argument("--model", help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    pd.add_argument("--out", help="output directory (default: the cache)")
    pd.add_argument("--layers", type=int, default=2, help="draft_model: decoder layers kept")
    pd.add_argument("--prompts", type=int, default=192)
    pd.add_argument("--max-tokens", type=int, default=128)
    pd.add_argument("--epochs", type=int, help="default: 4 (draft_model), 10 (eagle3); 0 (draft_model only): the "
                                               "target's first --layers layers as they are, in seconds")
    pd.add_argument("--force", action="store_true")
    v = sub.add_parser("verify-lossless", help="prove speculative sampling matches plain sampling (G-tests) and "
                                               "that returned log-probs match an independent forward pass")
    v.add_argument("--model", help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    from rollout_service.config import SPEC_METHODS

    add_flag(v, "engine.speculation.method", "--method", default="draft_model",
             choices=[m for m in SPEC_METHODS if m != "none"], help="speculative decoding method to check")
    add_flag(v, "engine.speculation.model", "--draft-model")
    add_flag(v, "engine.speculation.num_speculative_tokens", "-k", "--num-speculative-tokens", default=3)
    add_flag(v, "engine.speculation.draft_sampling", "--draft-sampling", default="probabilistic")
    add_flag(v, "engine.speculation.prompt_lookup_min", "--prompt-lookup-min")
    add_flag(v, "engine.speculation.prompt_lookup_max", "--prompt-lookup-max")
    add_flag(v, "engine.speculation.k_by_batch_size", "--k-by-batch-size")
    add_flag(v, "engine.speculation.k_control", "--k-control", default="fixed",
             help="as for serve (default fixed here: every step drafts k, the strictest test)")
    add_flag(v, "engine.quantization", "--quantization", default="none", choices=["none", "int8"],
             help="the served precision of both engines (as for serve); int8: the log-probs are checked against the "
                  "independent int8 W8A8 forward pass (drafting/reference.py), so the check proves speculation "
                  "lossless with respect to the served, quantized policy (default: none)")
    add_flag(v, "engine.speculation.quantization", "--draft-quantization", default="none", choices=["none", "int8"],
             help="the drafter's precision (draft_model only, as for serve) (default: none)")
    v.add_argument("--samples", type=int, default=400, help="samples per prompt per side")
    v.add_argument("--max-tokens", type=int, default=4, help="continuation length tested")
    v.add_argument("--temperature", type=float, default=1.0)
    v.add_argument("--top-k", type=int, default=10)
    v.add_argument("--top-p", type=float, default=1.0)
    v.add_argument("--alpha", type=float, default=1e-3, help="family-wise significance (Bonferroni)")
    v.add_argument("--logprob-samples", type=int,
                   help="speculative samples whose log-probs are compared with the independent forward pass "
                        "(default: 24; 6 with --quantization int8, whose reference computes every linear layer in "
                        "integer arithmetic, pair by pair as this CPU's int8 GEMM does: tens of seconds a sample)")
    v.add_argument("--prompts", nargs="*", default=["What is 12 + 30?", "Name a color."],
                   help="prompt texts (chat template applied)")
    v.add_argument("--prompt-ids", nargs="+", metavar="IDS",
                   help="prompts as token ids instead of --prompts, one comma-separated list each (e.g. prompts "
                        "that repeat what an n-gram drafter should match)")
    v.add_argument("--power-temperature", type=float, metavar="T",
                   help="also sample every prompt at temperature T on the speculative engine, in the same batches, "
                        "and compare those samples with the plain ones: the check must reject them (its power); "
                        "exit 1 if it does not")
    v.add_argument("--update-draft", metavar="DIR",
                   help="a drafter in the served drafter's format (an adapted head, a drafter copy), committed on the "
                        "speculative engine as UpdateDraft does once a third of its samples finished, the rest in "
                        "flight: the check covers a drafter updated mid-run")
    lora = v.add_mutually_exclusive_group()
    lora.add_argument("--adapter", metavar="DIR",
                      help="a LoRA adapter (PEFT directory) every request runs on, on both engines (the drafter drafts "
                           "for the base); log-probs against the base with it merged. The speculative engine also "
                           "samples every prompt without it in the same batches: the check must reject those (its "
                           "power; exit 1 if not)")
    lora.add_argument("--lora-rank", type=int, metavar="R",
                      help="as --adapter, with a random PEFT adapter of rank R on every linear layer of the decoder, "
                           "built for this run")
    v.add_argument("--lora-scale", type=float, default=1.0, metavar="S",
                   help="--lora-rank: each layer's update has S times its weight's Frobenius norm (default: 1.0; a "
                        "tiny random model needs more for its adapter to move the distribution)")
    return ap


def resolve_model(model: str | None) -> str:
    from rollout_service.models import is_model_dir, prepare_default_model

    if not model:
        return str(prepare_default_model())
    from pathlib import Path

    from rollout_service.moe_model import MOE_MODEL_NAME, prepare_moe_model

    if model == MOE_MODEL_NAME and not Path(model).exists():
        return str(prepare_moe_model())

    if not is_model_dir(Path(model)):
        raise SystemExit(f"--model {model}: not a Hugging Face model directory (needs config.json and "
                         "*.safetensors); nothing is downloaded from a hub")
    return model


def _prestart_engine_forkserver(tensor_parallel_size: int) -> None:
    """Engines that start in this process, from the fork server where they will take it: started now, so that its
    import of vLLM runs beside this process's own (engine/forkserver.prestart)."""
    from rollout_service.engine import forkserver
    from rollout_service.engine.patches import forkserver_expected

    if forkserver_expected():
        forkserver.prestart(tensor_parallel_size)


def cmd_serve(args) -> int:
    from rollout_service.config import ConfigError, load_config, parse_k_schedule

    try:
        overrides = {path: getattr(args, dest) for dest, path in SERVE_FLAGS.items()}
        if overrides["engine.speculation.k_by_batch_size"]:
            overrides["engine.speculation.k_by_batch_size"] = parse_k_schedule(
                overrides["engine.speculation.k_by_batch_size"])
        cfg = load_config(args.config, **overrides)
        from rollout_service.server.auth import load_credentials

        load_credentials(cfg.security, cfg.host)   # what it refuses (a remote bind without tokens): before vLLM loads
    except ConfigError as e:
        print(f"rollout-service: {e}", file=sys.stderr)
        return 2
    if not cfg.ray.address:          # the engines start here (a Ray actor starts its own): before vLLM is imported
        _prestart_engine_forkserver(cfg.engine.tensor_parallel_size)
    from rollout_service.server.app import serve

    try:
        asyncio.run(serve(cfg, resolve_model(cfg.engine.model)))
    except ConfigError as e:
        print(f"rollout-service: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_verify_lossless(args) -> int:
    import msgspec

    from rollout_service.config import ConfigError, load_config, parse_k_schedule
    from rollout_service.drafting.lossless import DEFAULT_BASE, check_lossless
    from rollout_service.model_info import ModelInfo

    try:                                 # the flags first: a bad one fails before the model is read
        cfg = load_config(**{"engine.speculation.method": args.method,
                              "engine.speculation.model": args.draft_model,
                              "engine.speculation.num_speculative_tokens": args.num_speculative_tokens,
                              "engine.speculation.draft_sampling": args.draft_sampling,
                              "engine.speculation.prompt_lookup_min": args.prompt_lookup_min,
                              "engine.speculation.prompt_lookup_max": args.prompt_lookup_max,
                              "engine.speculation.k_by_batch_size":
                                  parse_k_schedule(args.k_by_batch_size) if args.k_by_batch_size else None,
                              "engine.speculation.k_control": args.k_control,
                              "engine.speculation.quantization": args.draft_quantization,
                              "engine.quantization": args.quantization,
                              })
        spec = cfg.engine.speculation
    except ConfigError as e:
        print(f"rollout-service: {e}", file=sys.stderr)
        return 2
    if args.update_draft and not (Path(args.update_draft) / "model.safetensors").is_file() \
            and not Path(args.update_draft).is_file():
        print(f"rollout-service: --update-draft {args.update_draft}: no such drafter (a directory with "
              "model.safetensors, or the file)", file=sys.stderr)
        return 2
    if args.adapter or args.lora_rank is not None:
        problem = lora_problem(args)
        if problem:
            print(f"rollout-service: {problem}", file=sys.stderr)
            return 2
    if args.power_temperature is not None and not args.power_temperature > 0:
        print(f"rollout-service: --power-temperature {args.power_temperature}: must be > 0", file=sys.stderr)
        return 2
    # the check's engines start in this process: their fork server imports vLLM beside this process's own import
    _prestart_engine_forkserver(DEFAULT_BASE.tensor_parallel_size)
    model = resolve_model(args.model)
    info = ModelInfo.load(model, 2048)
    try:
        prompts = ([parse_prompt_ids(x, info.vocab_size) for x in args.prompt_ids] if args.prompt_ids
                   else [info.encode(p, chat=True) for p in args.prompts])
    except ValueError as e:
        print(f"rollout-service: --prompt-ids: {e}", file=sys.stderr)
        return 2
    base = msgspec.structs.replace(DEFAULT_BASE, quantization=cfg.engine.quantization)
    with tempfile.TemporaryDirectory(prefix="verify-lossless-adapter-") as scratch:
        adapter = args.adapter or ""
        if args.lora_rank is not None:
            from rollout_service.drafting.lossless import random_adapter

            adapter = random_adapter(model, args.lora_rank, scratch, relative=args.lora_scale)
        report = check_lossless(model, spec, prompts, samples=args.samples, max_tokens=args.max_tokens,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, alpha=args.alpha,
                                update_draft=args.update_draft, base=base, power_temperature=args.power_temperature,
                                adapter=adapter,
                                logprob_samples=args.logprob_samples or (6 if cfg.engine.quantization == "int8"
                                                                         else 24))
    print(report.render())
    if report.engine_failed:
        return 2
    if report.power is not None and report.power.passed_distribution:
        print(f"POWER NOT SHOWN: the samples at temperature {args.power_temperature} were not rejected")
        return 1
    if adapter and report.power_adapter.passed_distribution:
        print("POWER NOT SHOWN: the samples without the adapter were not rejected")
        return 1
    return 0 if report.passed else 1


def lora_problem(args) -> str | None:
    """What is wrong with verify-lossless's --adapter / --lora-rank (None: nothing)."""
    from rollout_service.config import LORA_RANKS
    from rollout_service.drafting.lossless import lora_rank_for

    if args.quantization != "none":
        return f"--quantization {args.quantization}: not with a LoRA adapter (--adapter, --lora-rank)"
    if args.lora_rank is not None:
        if not 1 <= args.lora_rank <= LORA_RANKS[-1]:
            return f"--lora-rank {args.lora_rank}: must be 1 to {LORA_RANKS[-1]} (vLLM's largest LoRA rank)"
        if not args.lora_scale > 0:
            return f"--lora-scale {args.lora_scale}: must be > 0"
        return None
    try:
        lora_rank_for(args.adapter)
    except ValueError as e:
        return f"--adapter {e}"
    return None


def parse_prompt_ids(text: str, vocab_size: int) -> list[int]:
    """'1,504,3458' -> [1, 504, 3458]; ValueError naming what is wrong (not an integer, out of the vocabulary)."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{text!r}: not a comma-separated list of token ids") from None
    if not ids:
        raise ValueError(f"{text!r}: an empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{text!r}: token ids {bad} outside the vocabulary (0 to {vocab_size - 1})")
    return ids


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

        if args.moe:
            from rollout_service.moe_model import prepare_moe_model

            print(prepare_moe_model(force=args.force, experts=args.experts, top_k=args.top_k))
        else:
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
            if args.epochs is not None and args.epochs < 1:
                raise SystemExit("prepare-drafter: --epochs must be >= 1 for --kind eagle3 (a head starts from random "
                                 "weights: it has no target layers to keep untrained, unlike --kind draft_model)")
            print(prepare_eagle3_head(resolve_model(args.model), out, prompts=args.prompts,
                                      max_tokens=args.max_tokens, epochs=10 if args.epochs is None else args.epochs,
                                      force=args.force))
        else:
            epochs = 4 if args.epochs is None else args.epochs
            print(prepare_draft_model(resolve_model(args.model), out, layers=args.layers, prompts=args.prompts,
                                      max_tokens=args.max_tokens, epochs=epochs, force=args.force))
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
