"""Runtimes that run a Plan: `eager` interprets it, `cudagraph` captures it once and replays it."""
