"""The ground floor every layer imports: the error taxonomy, child-process helpers,
telemetry, metrics instruments, redaction and URL checks. Imports nothing of the project
but `spec/`."""
