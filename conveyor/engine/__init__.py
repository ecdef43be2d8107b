"""The engine: the loop (`engine`), requests in (`input_processor`), what a step's results do to requests
(`output_processor`), the async pipeline (`async_batching`), the model runner and its padded buffers and
CUDA graphs (`model_runner`, `step_buffers`, `graph_runner`), the draft model's runner (`draft_runner`),
working-memory profiling (`memory_profile`), counters (`stats`) and the dashboard's step records
(`step_history`)."""
