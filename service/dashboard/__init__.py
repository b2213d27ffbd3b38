"""The web dashboard served at `/`: sign-in, jobs, devices, profiles (server-rendered)."""
