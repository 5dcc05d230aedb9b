from inference_queue_client.cli import main

raise SystemExit(main())
