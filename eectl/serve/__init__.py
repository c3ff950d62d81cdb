"""`eectl serve`: an artifact behind the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health) on
FastAPI + uvicorn, its requests continuously batched by the API's engine (eectl/run/engine.py). docs/cli/serve.md,
docs/design/serving.md."""
