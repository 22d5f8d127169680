"""The deployment lifecycle the engine adapters share (:mod:`.lifecycle`)."""
