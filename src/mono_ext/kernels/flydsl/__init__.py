"""The ``flydsl`` kernel backend: persistent K1/K2 launches for AMD MI355X (gfx950) in FlyDSL.

| module          | what                                                             | needs flydsl |
|-----------------|------------------------------------------------------------------|--------------|
| ``limits``      | gfx950 limits (CUs, VGPR file, LDS, clock), launch constants     | no           |
| ``toolchain``   | offline compile (``COMPILE_ONLY=1 ARCH=gfx950``, LLD shim), ISA  | to compile   |
|                 | metadata parser and the spill/scratch/LDS/residency checks; the  |              |
|                 | launcher and the dry launch (arguments vs the kernel's params)   |              |
| ``primitives``  | device code: tagged words, bounded waits on ``s_memrealtime``,   | yes          |
|                 | health records, sticky failure, peer-buffer all-reduce           |              |
| ``runtime``     | the runtime launches built from the primitives (mailbox, all-    | yes          |
|                 | reduce) and their offline builds                                 |              |
| ``k1``          | K1 (GDN and attention fronts): build keys, programs, host checks;| to compile   |
|                 | ``_k1_device`` holds the device code                             |              |
| ``k2``          | K2 (layer tail): build keys, hand-off program, host-side tensor  | to compile   |
|                 | checks and launch tables; ``_k2_device`` holds its device code   |              |
| ``sweep``       | every gfx950 build key compiled and checked (CI, docs/perf.md)   | yes          |
| ``backend``     | the backend's ``target``: the launch binding (a CPU dry run is   | to build     |
|                 | what ran), refusals, what is built / written / missing           |              |

Everything here compiles on a CPU machine; nothing here has run on an MI355X (no such device
was available where it was written): numerics on gfx950 are unverified until the Buildkite
MI355 step runs ``tests/kernels`` and ``tests/e2e`` there.
"""
