"""Rules vocabulary: operator facts, rule answers (Decision), the per-op registry, options, packs, errors."""
