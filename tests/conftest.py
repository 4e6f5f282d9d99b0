import os

# The suite decides itself when to patch: no auto-activation in this process or in the rank
# workers it spawns (they inherit the environment). Auto-activation has its own tests, which
# run subprocesses with their own environment.
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"
os.environ.setdefault("KERAS_BACKEND", "torch")

pytest_plugins = ["pytester"]
