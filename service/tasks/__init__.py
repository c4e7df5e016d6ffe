"""One module per task: preprocessing (tokenise, validate, window) and postprocessing (decode),
numpy only. Evaluation of an exported bundle runs through exactly this code."""
