"""The ``flydsl`` kernel backend of the Qwen3-Next family: persistent K1/K2 launches for AMD
MI355X (gfx950) in FlyDSL, on the generic device code and toolchain of ``kernels/flydsl``.

| module          | what                                                             | needs flydsl |
|-----------------|------------------------------------------------------------------|--------------|
| ``k1``          | K1 (GDN and attention fronts): build keys, programs, host checks;| to compile   |
|                 | ``_k1_device`` holds the device code                             |              |
| ``k2``          | K2 (layer tail): build keys, hand-off program, host-side tensor  | to compile   |
|                 | checks and launch tables; ``_k2_device`` holds its device code   |              |
| ``sweep``       | every gfx950 build key compiled and checked (CI, docs/journal.md)| yes          |
| ``backend``     | the backend's ``target``: the launch binding (a CPU dry run is   | to build     |
|                 | what ran), refusals, what is built / written / missing           |              |

Nothing here has run on an MI355X: numerics on gfx950 are unverified until the Buildkite MI355
step runs its device tests there (``.buildkite/gpu_step.sh``).
"""
