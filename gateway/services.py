"""The gateway app's verbs: views, API, commands and tasks call these."""
