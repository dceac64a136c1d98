"""The Gradio demo: the per-token transcript (no gradio), its HTML rendering, and the app (gradio, lazily)."""
