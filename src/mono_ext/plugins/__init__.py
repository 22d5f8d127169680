"""This distribution's own ``mono_ext`` entry points, one module per spec or backend.

They live apart from the code they register so that loading the registry
imports neither torch nor triton: targets are lazy ``module:attr`` strings and
probes import what they need when called.
"""
