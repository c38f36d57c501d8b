"""dcpstore inside trainers.  Each integration imports its trainer, which stays an optional extra: import the submodule."""
