"""Model code owned by the engine, and weight loading."""
