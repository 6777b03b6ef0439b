"""The recipe: its sections and fields, cross-field rules, overrides, the package configs it
builds, start-up checks and the command line."""
