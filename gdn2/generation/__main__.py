from gdn2.generation.cli import main

raise SystemExit(main())
