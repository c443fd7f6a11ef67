"""HTTP front end of horizon-ray (FastAPI); talks to the coordinator through one client object."""
