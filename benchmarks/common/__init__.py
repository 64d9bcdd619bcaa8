"""What several benchmarks share: variant timing, trace summaries, the GPU lock, the Cloud Storage emulator."""
