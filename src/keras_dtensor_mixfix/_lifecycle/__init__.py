"""Patch lifecycle: install the dispatch rules into torch, patch/unpatch/patched, options in force."""
