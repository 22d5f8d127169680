"""Entry-point plugin (group ``mono_ext``) registering the Qwen3-Next spec."""

from ..core.hookspecs import hookimpl


@hookimpl
def mono_ext_model_specs():
    from ..models.qwen3_next.spec import Qwen3NextSpec

    return [Qwen3NextSpec]
