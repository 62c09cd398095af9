"""Layer 3 — model execution (not built yet).

Will hold a Llama-family executor in plain PyTorch that loads Hugging Face
`config.json` + `model.safetensors` + `tokenizer.json`, sampling, and the course model
trained on Shakespeare.
"""
