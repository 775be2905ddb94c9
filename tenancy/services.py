"""The tenancy app's verbs: views, API, commands and tasks call these."""
