"""May the Keras integration install into the running Keras, and the Keras self-check behind that answer.

- :mod:`.keras_gate`: which Keras releases the integration installs into (and the opt-in for a newer one);
- :mod:`.checks`: one named check per Keras private name or behaviour the integration relies on;
- :mod:`.selfcheck`: runs the checks, in a process of their own, for ``doctor`` and the gate.
"""
